"""Where a whole request's time goes on the GPU: prefill, decoding, and everything around them.

`dflash bench speed` divides completion tokens by each request's wall time, so per-request work outside the
decoding loop (prompt prefill, the first speculative round, graph captures, the dropped queued round) counts as
much as the rounds do. For each mode this runs the speed table's prompts through `Engine.generate` (after a
warm-up over every prompt) and reports, summed over the prompts: wall seconds, prefill seconds, decode seconds
(`GenerationStats`), the rest, completion tokens and rounds; then a cProfile of one request per mode.

Usage: PYTHONPATH=src python benchmarks/gpu_request_profile.py --model GGUF --prompts-file F [...] --out OUT.json
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import io
import json
import platform
import pstats
import sys
import time
from pathlib import Path
from typing import Any

import torch

from dflash.engine.loading import LoadOptions, load_engine
from dflash.generation.request import GenerationRequest
from dflash.training.prompts import read_prompt_file

MODES = {"ar": "none", "linear": "linear", "ddtree": "ddtree"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompts-file", type=Path, action="append", required=True)
    parser.add_argument("--limit", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    engine = load_engine(args.model, "default", loading=LoadOptions(device="cuda", dtype="bfloat16"))
    prompts = [engine.chat_prompt_ids(chat) for path in args.prompts_file for chat in read_prompt_file(path)[: args.limit]]
    modes: dict[str, Any] = {}
    profiles: dict[str, list[str]] = {}
    for name, spec in MODES.items():
        for ids in prompts:  # warm-up: every prompt's graph shapes captured
            engine.generate(GenerationRequest(prompt_ids=ids, max_new_tokens=args.max_tokens), spec=spec)
        totals = {"wall_s": 0.0, "prefill_s": 0.0, "decode_s": 0.0, "tokens": 0, "rounds": 0}
        for ids in prompts:
            torch.cuda.synchronize()
            started = time.perf_counter()
            result = engine.generate(GenerationRequest(prompt_ids=ids, max_new_tokens=args.max_tokens), spec=spec)
            torch.cuda.synchronize()
            totals["wall_s"] += time.perf_counter() - started
            totals["prefill_s"] += result.stats.prefill_s
            totals["decode_s"] += result.stats.decode_s
            totals["tokens"] += result.stats.completion_tokens
            totals["rounds"] += result.stats.rounds or result.stats.completion_tokens
        totals["other_s"] = totals["wall_s"] - totals["prefill_s"] - totals["decode_s"]
        totals["tokens_per_s"] = totals["tokens"] / totals["wall_s"]
        totals["decode_tokens_per_s"] = totals["tokens"] / totals["decode_s"]
        totals["ms_per_round_in_decode"] = totals["decode_s"] / totals["rounds"] * 1e3
        modes[name] = {key: round(value, 5) if isinstance(value, float) else value for key, value in totals.items()}
        print(name, modes[name], flush=True)
        profiler = cProfile.Profile()
        profiler.enable()
        engine.generate(GenerationRequest(prompt_ids=prompts[0], max_new_tokens=args.max_tokens), spec=spec)
        profiler.disable()
        stream = io.StringIO()
        pstats.Stats(profiler, stream=stream).sort_stats("cumulative").print_stats(30)
        profiles[name] = stream.getvalue().splitlines()
        print("\n".join(profiles[name]), flush=True)
    result_json = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(),
        "versions": {"python": platform.python_version(), "torch": torch.__version__},
        "command": " ".join(["python", *sys.argv]),
        "prompts": len(prompts),
        "max_tokens": args.max_tokens,
        "ddtree_budget": engine.options.ddtree_budget,
        "modes": modes,
        "cprofile_one_request_cumulative": profiles,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result_json, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
