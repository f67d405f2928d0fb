"""The drafter's products on the CPU: one-part int8 inputs (its default beside an int8x2 target) against two-part.

Loads the default engine (DDTree speculating every round, so every round drafts) and, taking turns `--repeats` times,
puts the drafter's matrices and its shortlist head on int8x2 then int8 products and decodes `--prompts` HumanEval and
MT-Bench prompts each (`--max-tokens`): the drafter round's median time, the acceptance length, decode tokens/s, and
whether both give the same tokens (they must: drafts are only proposals).

    python benchmarks/cpu_drafter_products.py --out results/cpu_drafter_products.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from dflash.bench.provenance import provenance, write_result
from dflash.engine.engine import EngineOptions
from dflash.engine.loading import load_engine
from dflash.generation.request import GenerationRequest
from dflash.models.cpu_matmul import use_cpu_matmul
from dflash.models.quantized_layers import QuantizedLinear
from dflash.training.prompts import read_prompt_file

PROMPTS = Path(__file__).parent / "prompts"
KINDS = ("int8x2", "int8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=5, help="prompts per file")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    engine = load_engine("default", options=EngineOptions(max_batch=1, spec="ddtree", always_speculate=True))
    drafter = engine.drafter
    assert drafter is not None and engine.cpu_matmul == "int8x2", "needs the int8x2 CPU default"
    engine.warm_up()
    head = drafter.draft_head.rows if drafter.draft_head is not None else None
    chats = [chat for name in ("humaneval", "mtbench") for chat in read_prompt_file(PROMPTS / f"{name}.jsonl")[: args.prompts]]
    prompts = [engine.prompt_set_ids(chat) for chat in chats]
    rounds: list[float] = []
    original: Callable[..., Any] = type(drafter).draft_scores

    def timed(self: Any, *call: Any, **named: Any) -> Any:
        started = time.perf_counter()
        out = original(self, *call, **named)
        rounds.append(time.perf_counter() - started)
        return out

    drafter.draft_scores = timed.__get__(drafter)  # type: ignore[method-assign]
    figures: dict[str, dict[str, list[float]]] = {kind: {"round_ms": [], "acceptance": [], "tokens_per_s": []} for kind in KINDS}
    tokens: dict[str, list[list[int]]] = {}
    for _ in range(args.repeats):
        for kind in KINDS:
            use_cpu_matmul(drafter, kind)
            if isinstance(head, QuantizedLinear):
                head.use_products(kind)
            rounds.clear()
            produced, decode_s, accepted = [], 0.0, []
            for ids in prompts:
                out = engine.generate(GenerationRequest(prompt_ids=ids, max_new_tokens=args.max_tokens), spec="ddtree")
                produced.append(out.token_ids)
                decode_s += out.stats.decode_s
                accepted.append(out.stats.acceptance_length or 0.0)
            figures[kind]["round_ms"].append(1000 * statistics.median(rounds))
            figures[kind]["acceptance"].append(statistics.fmean(accepted))
            figures[kind]["tokens_per_s"].append(sum(map(len, produced)) / decode_s)
            tokens[kind] = produced
    medians = {kind: {name: round(statistics.median(values), 3) for name, values in table.items()}
               for kind, table in figures.items()}
    result: dict[str, Any] = {
        **provenance(engine.device),
        "command": "python benchmarks/cpu_drafter_products.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out"),
        "model": engine.model_name, "target_products": engine.cpu_matmul, "threads": torch.get_num_threads(),
        "prompts": len(prompts), "max_tokens": args.max_tokens, "repeats": args.repeats,
        "medians": medians,
        "int8_over_int8x2": {name: round(medians["int8"][name] / medians["int8x2"][name], 3) for name in medians["int8"]},
        "same_tokens": tokens["int8"] == tokens["int8x2"],
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
    write_result(result, args.out)


if __name__ == "__main__":
    main()
