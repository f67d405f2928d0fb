"""Where one-request plain decoding's GPU time goes for a GGUF target: the kernels of its replayed step graphs, by
name, under torch's profiler (CUPTI records each kernel a graph replay runs).

Loads `--model` with `--weights` (quantized: the GGUF's 4-bit matrices as words; dense: bf16), no drafter, CUDA
graphs; decodes `--tokens` tokens after a short random prompt once untimed, once timed (tokens/s and ms per token
from `GenerationStats`), then once more under the profiler, and prints the kernels that took the most GPU time: us
per token, calls per token. `--json` writes the table and the timing.

Usage: python benchmarks/gpu_decode_profile.py --model FILE.gguf [--weights quantized] [--tokens 64] [--json F]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from dflash.engine.engine import EngineOptions
from dflash.engine.loading import LoadOptions, load_engine
from dflash.generation.request import GenerationRequest
from dflash.generation.sampling import SamplingParams


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--weights", default="quantized")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    engine = load_engine(args.model, "none", options=EngineOptions(max_batch=1),
                         loading=LoadOptions(weights=args.weights))
    vocab = engine.target.config.vocab_size
    ids = torch.randint(10, vocab - 10, (args.prompt,), generator=torch.Generator().manual_seed(0)).tolist()
    request = GenerationRequest(prompt_ids=ids, max_new_tokens=args.tokens, ignore_eos=True,
                                sampling=SamplingParams(temperature=0.0))
    engine.generate(request)  # graphs captured, kernels compiled
    timed = engine.generate(request).stats
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine.generate(request)
        torch.cuda.synchronize()
    tokens = args.tokens
    rows = []
    for event in prof.key_averages():
        gpu_us = getattr(event, "device_time_total", 0.0) or getattr(event, "cuda_time_total", 0.0)
        if gpu_us <= 0 or event.key.startswith(("ProfilerStep", "cudaGraphLaunch")):
            continue
        rows.append({"kernel": event.key[:120], "gpu_us": round(gpu_us, 1), "calls": event.count,
                     "us_per_token": round(gpu_us / tokens, 1)})
    rows.sort(key=lambda r: -r["gpu_us"])
    total = sum(r["gpu_us"] for r in rows) / tokens
    print(f"{args.weights}: {timed.tokens_per_s:.1f} tokens/s ({1000 / timed.tokens_per_s:.3f} ms per token); "
          f"kernels' GPU time {total:.1f} us per token (prompt and first token included)")
    for row in rows[: args.top]:
        print(f"{row['us_per_token']:9.1f} us/token {row['calls'] / tokens:7.1f} calls/token  {row['kernel']}")
    if args.json:
        args.json.write_text(json.dumps({
            "model": Path(args.model).name, "weights": args.weights, "tokens": tokens,
            "tokens_per_s": round(timed.tokens_per_s, 1), "kernel_us_per_token": round(total, 1),
            "device": torch.cuda.get_device_name(), "kernels": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
