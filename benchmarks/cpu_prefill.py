"""Prompt processing on the CPU: tokens/s of the default model's chunked prefill (quantized target), the number
a long agent prompt's time to first token depends on.

Times `chunked_prefill` of 512 and 2,048 prompt tokens (random ids, chunks of 256 as `dflash serve` uses),
best of `--repeats`, with the drafter's features captured as in speculative decoding.

    python benchmarks/cpu_prefill.py --out results/cpu_prefill.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from dflash.bench.provenance import provenance
from dflash.engine.engine import EngineOptions
from dflash.engine.loading import LoadOptions, load_engine
from dflash.generation.prefill import chunked_prefill


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="512,2048")
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    engine = load_engine("default", None, options=EngineOptions(), loading=LoadOptions(device="cpu"))
    target, drafter = engine.target, engine.drafter
    capture = drafter.config.target_layer_ids if drafter is not None else ()
    figures: dict[str, Any] = {}
    for length in (int(n) for n in args.lengths.split(",")):
        ids = torch.randint(100, target.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(0))
        best = float("inf")
        for _ in range(args.repeats):
            cache = target.new_cache(length + 16)
            started = time.perf_counter()
            chunked_prefill(target, cache, ids, chunk=args.chunk, capture=capture)
            best = min(best, time.perf_counter() - started)
        figures[str(length)] = {"seconds": round(best, 3), "tokens_per_s": round(length / best, 1)}
        print(f"{length} tokens: {best:.2f} s, {length / best:.1f} tokens/s", flush=True)
    result = {**provenance(engine.device), "command": "python benchmarks/cpu_prefill.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None and k != "out"),
        "model": engine.model_name, "chunk": args.chunk, "prefill": figures}
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
