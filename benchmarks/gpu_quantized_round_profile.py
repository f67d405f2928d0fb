"""Where a decoding round of a quantized GGUF model goes on one GPU: the kernels of a few plain steps and a few
DDTree rounds (torch.profiler, device time per kernel name, summed), and the rounds' wall time.

The model and drafter as `gpu_hybrid_fit.py` makes them (a random Qwen3.5-27B Q4_K_M file and a random drafter of
the published layout) or any GGUF and drafter folder given; `load_engine` with `--weights quantized`, one request
at a time. A short random prompt; `--tokens` new tokens per profiled generation after an unprofiled warm-up.
Variants, each its own engine in this process (`--variants`):
* `fused`: as the engine runs (a hybrid's fused forward over the GGUF matrices where it serves);
* `unfused`: the runner's unfused static forwards (`supports_fused_hybrid` answering no);
* `before`: unfused, and the tensor-core word product with one reduction per 64 output columns (no split, the
  configuration before the split reductions).

Usage: python benchmarks/gpu_quantized_round_profile.py --out results/FILE.json [--model GGUF --drafter DIR]
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import torch
from gpu_hybrid_fit import make_drafter  # benchmarks/ is on the path
from torch.profiler import ProfilerActivity, profile

from dflash.bench.provenance import provenance
from dflash.bench.random_gguf import write_random_gguf
from dflash.engine.engine import EngineOptions
from dflash.engine.loading import LoadOptions, load_engine
from dflash.generation.forwards import forwards_for
from dflash.generation.request import GenerationRequest
from dflash.generation.sampling import SamplingParams
from dflash.models.gguf_loader import open_gguf_model


def profiled(engine: Any, spec: str, tokens: int, top: int) -> dict[str, Any]:
    vocab = engine.target.config.vocab_size
    ids = torch.randint(10, vocab - 10, (32,), generator=torch.Generator().manual_seed(1)).tolist()
    request = GenerationRequest(prompt_ids=ids, max_new_tokens=tokens, ignore_eos=True, use_prefix_cache=False,
                                sampling=SamplingParams(temperature=0.0))
    engine.generate(request, spec=spec)  # warm-up: graphs captured, programs compiled
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        started = time.perf_counter()
        stats = engine.generate(request, spec=spec).stats
        torch.cuda.synchronize()
        wall = time.perf_counter() - started
    kernels: dict[str, float] = {}
    for event in prof.key_averages():
        if event.device_time_total > 0:
            kernels[event.key] = kernels.get(event.key, 0.0) + event.device_time_total / 1e3  # ms
    rounds = max(1, stats.rounds or stats.completion_tokens - 1)
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1])[:top]
    return {
        "rounds": rounds, "completion_tokens": stats.completion_tokens, "wall_s": round(wall, 3),
        "decode_tok_s": round(stats.tokens_per_s, 2),
        "device_ms_per_round": round(sum(kernels.values()) / rounds, 3),
        "top_kernels_ms_per_round": {name[:90]: round(ms / rounds, 3) for name, ms in ranked},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=Path("/tmp/qwen3.5-27b-q4_k_m.gguf"))
    parser.add_argument("--drafter", type=Path, default=Path("/tmp/qwen3.5-27b-drafter"))
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--specs", default="none,ddtree")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--variants", default="before,unfused,fused")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if not args.model.is_file():
        write_random_gguf(args.model, "qwen3.5-27b", "q4_k_m")
    if not (args.drafter / "config.json").is_file():
        make_drafter(open_gguf_model(args.model)[1], args.drafter)
    result: dict[str, Any] = {**provenance(torch.device("cuda")), "settings": {
        k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, "variants": {}}
    for variant in args.variants.split(","):
        with patched(variant):
            engine = load_engine(str(args.model), str(args.drafter),
                                 options=EngineOptions(max_batch=1, max_ctx=4096), loading=LoadOptions(weights="quantized"))
            engine.warm_up()
            runner = getattr(forwards_for(engine.target), "runner", None)
            profiles = result["variants"][variant] = {"fused": getattr(runner, "fused", None)}
            for spec in args.specs.split(","):
                profiles[spec] = profiled(engine, spec, args.tokens, args.top)
                print(variant, spec, json.dumps(profiles[spec], indent=1), flush=True)
            engine.close()
            del engine
            gc.collect()
            torch.cuda.empty_cache()
        args.out.write_text(json.dumps(result, indent=1) + "\n")


@contextmanager
def patched(variant: str) -> Iterator[None]:
    """The engine's choices for `variant` (see the module docstring)."""
    from dflash.fastpath import fused_hybrid
    from dflash.kernels import triton_gguf_int8

    saved = fused_hybrid.supports_fused_hybrid, triton_gguf_int8.nibble_dot
    if variant in ("unfused", "before"):
        fused_hybrid.supports_fused_hybrid = lambda model: False
    if variant == "before":
        triton_gguf_int8.nibble_dot = partial(saved[1], block_n=64, splits=1)
    try:
        yield
    finally:
        fused_hybrid.supports_fused_hybrid, triton_gguf_int8.nibble_dot = saved


if __name__ == "__main__":
    main()
