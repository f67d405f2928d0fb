"""Where the batched step's GPU time goes: the kernels of the engine's padded CUDA graphs, by name, under torch's
profiler (CUPTI records each kernel a graph replay runs).

Builds the random model of `batch_loop_overhead.py` (`--layers`, `--hidden`, `--vocab`; bf16, CUDA graphs captured
by warm-up), runs `--clients` concurrent plain (or `--mode ddtree`) requests of `--max-tokens` tokens once untimed,
then again under the profiler, and prints the kernels that took the most GPU time: total microseconds, calls, and
microseconds per step (steps counted by the core). `--json` writes the table.

Usage: python benchmarks/gpu_batched_step_profile.py --layers 30 --hidden 576 --vocab 49152 --clients 1 [--json F]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
from batch_loop_overhead import (  # benchmarks/ is the folder
    PROMPT_TOKENS,
    StepClock,
    build_engine,
    in_process,
)
from torch.profiler import ProfilerActivity, profile


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--shape", choices=("tiny", "smollm2"), default="tiny",
                        help="smollm2: the default target's and drafter's shapes (--layers, --hidden ignored)")
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--clients", type=int, default=1)
    parser.add_argument("--mode", default="plain", choices=("plain", "ddtree"))
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=PROMPT_TOKENS)
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--budget", type=int, default=32)
    parser.add_argument("--max-step-rows", type=int, default=256)
    parser.add_argument("--step", default="padded")
    parser.add_argument("--tokenizer-json", type=Path, default=None)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    device = torch.device("cuda")
    engine = build_engine(args, device)
    clock = StepClock(engine)
    prompts = [[(7 * i + j) % (args.vocab - 10) + 5 for j in range(args.prompt_tokens)] for i in range(args.clients)]

    run: Any = in_process(engine, prompts, mode=args.mode, clients=args.clients, requests=args.clients,
                          max_tokens=args.max_tokens)

    run()  # untimed: every shape met once
    clock.reset()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        run()
        torch.cuda.synchronize()
    steps = max(1, clock.steps)
    rows = []
    for event in prof.key_averages():
        gpu_us = getattr(event, "device_time_total", 0.0) or getattr(event, "cuda_time_total", 0.0)
        if gpu_us <= 0 or event.key.startswith(("ProfilerStep", "cudaGraphLaunch")):
            continue
        if getattr(event, "device_type", None) is not None and "CUDA" not in str(event.device_type):
            continue
        rows.append({"kernel": event.key[:120], "gpu_us": round(gpu_us, 1), "calls": event.count,
                     "us_per_step": round(gpu_us / steps, 1)})
    rows.sort(key=lambda r: -r["gpu_us"])
    total = sum(r["gpu_us"] for r in rows)
    print(f"steps {steps}, kernels' GPU time {total / steps:.1f} us per step, {args.layers} layers, "
          f"{args.clients} clients, mode {args.mode}")
    for row in rows[: args.top]:
        print(f"{row['us_per_step']:9.1f} us/step {row['calls'] / steps:7.1f} calls/step  {row['kernel']}")
    if args.json:
        args.json.write_text(json.dumps({"steps": steps, "per_step_us": round(total / steps, 1), "args": {
            k: str(v) for k, v in vars(args).items()}, "kernels": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
