"""Where a speculative round's time goes on the CPU: target forwards by row count, the drafter's rounds, acceptance.

Decodes `--prompts` HumanEval prompts with plain decoding and with DDTree (`--ddtree-budget`, 4 by default) on the default
model, timing every target forward (grouped by its number of input rows: 1 = a plain step, budget + 1 = a DDTree
verification, more = prefill) and every drafter round, and reports the mean milliseconds of each, the round's cost in
plain steps and the tokens accepted per round: the cost model behind the CPU speed ratios. `whole_round_ms` is the
decoding time per round (per token for plain decoding) with everything else in it: tree building, the target's
choices, cache moves.

    python benchmarks/cpu_round_costs.py --out results/cpu_round_costs.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dflash.bench.provenance import provenance, write_result
from dflash.engine.engine import EngineOptions
from dflash.engine.loading import LoadOptions, load_engine
from dflash.generation.request import GenerationRequest
from dflash.training.prompts import read_prompt_file

PROMPTS = Path(__file__).parent / "prompts"


def timed(function: Callable[..., Any], key: Callable[..., str], store: dict[str, list[float]]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        out = function(*args, **kwargs)
        store[key(*args, **kwargs)].append((time.perf_counter() - started) * 1000)
        return out

    return wrapper


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--ddtree-budget", type=int, default=4)
    parser.add_argument("--cpu-matmul", default="auto", choices=["auto", "float32", "amx"])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    engine = load_engine("default", None, options=EngineOptions(spec="ddtree", ddtree_budget=args.ddtree_budget),
                         loading=LoadOptions(device="cpu", cpu_matmul=args.cpu_matmul))
    assert engine.drafter is not None
    chats = read_prompt_file(PROMPTS / "humaneval.jsonl")[: args.prompts]
    requests = [engine.chat_prompt_ids(chat) for chat in chats]
    engine.generate(GenerationRequest(prompt_ids=requests[0], max_new_tokens=8), spec="ddtree")  # warm-up
    figures: dict[str, Any] = {}
    for spec in ("none", "ddtree"):
        times: dict[str, list[float]] = defaultdict(list)
        target, drafter = engine.target, engine.drafter
        target.forward = timed(type(target).forward.__get__(target),  # type: ignore[method-assign]
                               lambda ids, *a, **k: f"target_{ids.shape[1]}_rows", times)
        drafter.draft_scores = timed(type(drafter).draft_scores.__get__(drafter),  # type: ignore[method-assign]
                                     lambda *a, **k: "drafter_round", times)
        accepted, decode_s, rounds = [], 0.0, 0
        for ids in requests:
            result = engine.generate(GenerationRequest(prompt_ids=ids, max_new_tokens=args.max_tokens), spec=spec)
            accepted.append(result.stats.acceptance_length)
            decode_s += result.stats.decode_s
            rounds += result.stats.rounds or result.stats.completion_tokens - 1
        del target.forward, drafter.draft_scores  # back to the class methods
        figures[spec] = {name: {"calls": len(values), "mean_ms": round(statistics.fmean(values), 2)}
                         for name, values in sorted(times.items())}
        figures[spec]["whole_round_ms"] = round(decode_s * 1000 / rounds, 2)  # everything between the prefills
        if spec == "ddtree":
            figures[spec]["acceptance_length"] = round(statistics.fmean(accepted), 3)
    step = figures["none"]["target_1_rows"]["mean_ms"]
    rows = args.ddtree_budget + 1
    verify = figures["ddtree"][f"target_{rows}_rows"]["mean_ms"]
    draft = figures["ddtree"]["drafter_round"]["mean_ms"]
    whole = figures["ddtree"]["whole_round_ms"]
    figures["in_plain_steps"] = {f"verify_{rows}_rows": round(verify / step, 2), "drafter_round": round(draft / step, 2),
                                 "round": round((verify + draft) / step, 2),
                                 "whole_round": round(whole / figures["none"]["whole_round_ms"], 2)}
    result: dict[str, Any] = {**provenance(engine.device), "command": "python benchmarks/cpu_round_costs.py "
                              f"--prompts {args.prompts} --max-tokens {args.max_tokens} --ddtree-budget {args.ddtree_budget} "
                              f"--cpu-matmul {args.cpu_matmul}",
                              "cpu_matmul": engine.cpu_matmul,
                              "model": engine.model_name, "figures": figures}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
    write_result(result, args.out)


if __name__ == "__main__":
    main()
