"""What the CPU speculation gate measures and chooses, request by request (`dflash.speculative.gate`).

Loads an engine on the CPU (the gate on), answers the first `--limit` prompts of HumanEval and MT-Bench with greedy
DDTree one at a time, and records per request its tokens/s, speculative rounds and plain steps and its tokens per
round, and at the end the engine's means: time of a speculative round and of a plain step, tokens per round.

Usage: python benchmarks/cpu_gate_costs.py --model default --limit 3 --out results/FILE.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import dflash.engine.engine as engine_module
from dflash.bench.provenance import provenance
from dflash.engine.engine import EngineOptions
from dflash.engine.loading import load_engine
from dflash.generation.request import GenerationRequest
from dflash.speculative.gate import SpeculationGate
from dflash.training.prompts import read_prompt_file

PROMPTS = [Path("benchmarks/prompts/humaneval.jsonl"), Path("benchmarks/prompts/mtbench.jsonl")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--limit", type=int, default=3, help="prompts per file")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    gates: list[SpeculationGate] = []

    class Recorded(SpeculationGate):  # the engine's gates, kept for their choices
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            gates.append(self)

    engine_module.SpeculationGate = Recorded  # type: ignore[misc]
    engine = load_engine(args.model, options=EngineOptions(max_batch=1))
    assert engine.gate_costs is not None, "the gate runs on the CPU only"
    chats = [chat for path in PROMPTS for chat in read_prompt_file(path)[: args.limit]]
    requests: list[dict[str, Any]] = []
    for chat in chats:
        ids = engine.prompt_set_ids(chat)
        started = time.perf_counter()
        out = engine.generate(GenerationRequest(prompt_ids=ids, max_new_tokens=args.max_tokens), spec="ddtree")
        seconds = time.perf_counter() - started
        gate = gates[-1]
        requests.append({
            "tokens_per_s": round(len(out.token_ids) / seconds, 2),
            "speculative_rounds": sum(gate.choices), "plain_steps": len(gate.choices) - sum(gate.choices),
            "tokens_per_round": None if gate.tokens is None else round(gate.tokens, 3),
        })
        print(json.dumps(requests[-1]))
    costs = engine.gate_costs["ddtree"]
    result = {
        **provenance(engine.device), "model": args.model, "max_tokens": args.max_tokens,
        "ddtree_budget": engine.options.ddtree_budget, "cpu_matmul": engine.cpu_matmul, "requests": requests,
        "engine_means": {
            "speculative_round_ms": None if costs.spec_seconds is None else round(costs.spec_seconds * 1e3, 3),
            "plain_step_ms": None if costs.plain_seconds is None else round(costs.plain_seconds * 1e3, 3),
            "tokens_per_round": None if costs.tokens is None else round(costs.tokens, 3),
        },
    }
    print(json.dumps(result["engine_means"]))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
