"""The native decoder layers (`dflash.models.native_stack`) against the same layers run from Python, in one process.

Loads the default engine on the CPU and, taking turns (`DFLASH_CPU_NATIVE_LAYERS` 1, then 0, `--repeats` times),
times (a) the target's forward of 1 row (a plain step) and of `--rows` rows under a tree mask (a DDTree verification)
over a cache of `--context` slots, best of `--calls` calls, and (b) whole greedy generations of `--prompts` HumanEval
and MT-Bench prompts (`--max-tokens` each) in plain decoding and in DDTree speculating every round (with the median
drafter round); it checks that both ways give the same tokens, and reports the medians over the repeats and the
speedups (python time / native time). The switch covers the target's layers and the drafter's.

    python benchmarks/cpu_native_layers.py --out results/cpu_native_layers.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from dflash.bench.provenance import provenance, write_result
from dflash.engine.engine import Engine, EngineOptions
from dflash.engine.loading import load_engine
from dflash.generation.request import GenerationRequest
from dflash.models.model import CausalLM
from dflash.models.native_stack import runs_natively
from dflash.training.prompts import read_prompt_file

PROMPTS = Path(__file__).parent / "prompts"
SWITCH = "DFLASH_CPU_NATIVE_LAYERS"


def forward_ms(target: CausalLM, rows: int, context: int, calls: int) -> float:
    """Best time of a `rows`-row forward (a tree mask when rows > 1) after `context` committed slots."""
    cache = target.new_cache(context + rows)
    ids = torch.randint(0, target.config.vocab_size, (1, context), generator=torch.Generator().manual_seed(0))
    target(ids, cache=cache, logits="none")
    tree = torch.tril(torch.ones(rows, rows, dtype=torch.bool))
    new = ids[:, :rows]
    positions = torch.arange(context, context + rows)[None]
    best = float("inf")
    for _ in range(calls):
        started = time.perf_counter()
        target(new, positions=positions, cache=cache, tree_mask=tree if rows > 1 else None, logits="all")
        best = min(best, time.perf_counter() - started)
        cache.crop(context)
    return best * 1000


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompts", type=int, default=3, help="prompts per file")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rows", type=int, default=5)
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)


def compare_ways(
    engine: Engine, ways: dict[str, Callable[[], None]], args: argparse.Namespace, script: str
) -> dict[str, Any]:
    """Taking turns between `ways` (each a call that switches the engine to it), `args.repeats` times: a plain step,
    a verification of `args.rows` rows, and whole greedy generations in plain decoding and in DDTree speculating
    every round. Returns the result's common fields: medians per way, the first way's speedup over the second,
    acceptance, and whether every way gave the same tokens."""
    recorded = provenance(engine.device)  # before any switch sets its variable
    chats = [chat for name in ("humaneval", "mtbench") for chat in read_prompt_file(PROMPTS / f"{name}.jsonl")[: args.prompts]]
    prompts = [engine.prompt_set_ids(chat) for chat in chats]
    drafter = engine.drafter
    assert drafter is not None
    draft_rounds: list[float] = []
    draft_scores: Callable[..., Any] = type(drafter).draft_scores

    def timed_round(self: Any, *call: Any, **named: Any) -> Any:
        started = time.perf_counter()
        out = draft_scores(self, *call, **named)
        draft_rounds.append(time.perf_counter() - started)
        return out

    drafter.draft_scores = timed_round.__get__(drafter)  # type: ignore[method-assign]
    figures: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    tokens: dict[str, dict[str, list[list[int]]]] = defaultdict(dict)
    acceptance: dict[str, float] = {}
    with torch.inference_mode():
        for _ in range(args.repeats):
            for way, switch in ways.items():
                switch()
                figures[way]["step_1_row_ms"].append(forward_ms(engine.target, 1, args.context, args.calls))
                figures[way][f"verify_{args.rows}_rows_ms"].append(
                    forward_ms(engine.target, args.rows, args.context, args.calls))
                for spec in ("none", "ddtree"):
                    draft_rounds.clear()
                    produced, seconds, accepted = [], 0.0, []
                    for ids in prompts:
                        started = time.perf_counter()
                        out = engine.generate(GenerationRequest(prompt_ids=ids, max_new_tokens=args.max_tokens), spec=spec)
                        seconds += time.perf_counter() - started
                        produced.append(out.token_ids)
                        accepted.append(out.stats.acceptance_length or 0.0)
                    mode = "plain" if spec == "none" else "ddtree"
                    if draft_rounds:
                        figures[way]["drafter_round_ms"].append(1000 * statistics.median(draft_rounds))
                    figures[way][f"{mode}_tokens_per_s"].append(sum(map(len, produced)) / seconds)
                    tokens[way][mode] = produced
                    acceptance[mode] = statistics.fmean(accepted)
    medians = {way: {name: round(statistics.median(values), 3) for name, values in table.items()}
               for way, table in figures.items()}
    first, second = list(ways)[:2]
    return {
        **recorded,
        "command": f"python benchmarks/{script} " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out"),
        "model": engine.model_name, "cpu_matmul": engine.cpu_matmul, "threads": torch.get_num_threads(),
        "prompts": len(prompts), "max_tokens": args.max_tokens, "repeats": args.repeats,
        "medians": medians,
        f"{first}_speedup": {  # the second way's time / the first's (tokens/s: the first's / the second's)
            name: round(medians[first][name] / medians[second][name], 3) if name.endswith("per_s")
            else round(medians[second][name] / medians[first][name], 3) for name in medians[first]},
        "ddtree_acceptance_length": round(acceptance["ddtree"], 3),
        "same_tokens": {mode: all(tokens[way][mode] == tokens[first][mode] for way in ways) for mode in ("plain", "ddtree")},
        "ddtree_tokens_are_plain_tokens": tokens[first]["ddtree"] == tokens[first]["plain"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    args = parser.parse_args()
    engine = load_engine("default", options=EngineOptions(max_batch=1, spec="ddtree", always_speculate=True))
    engine.warm_up()

    def switch(flag: str) -> Callable[[], None]:
        return lambda: os.environ.__setitem__(SWITCH, flag)

    result = compare_ways(engine, {"native": switch("1"), "python": switch("0")}, args, "cpu_native_layers.py")
    os.environ.pop(SWITCH, None)
    result["ran_natively"] = runs_natively(engine.target)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
    write_result(result, args.out)


if __name__ == "__main__":
    main()
