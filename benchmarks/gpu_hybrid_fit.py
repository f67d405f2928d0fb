"""A quantized Qwen3.5-27B-shaped hybrid, its drafter and a full context under a GPU memory cap, as a user runs it.

Makes (unless given) a random-weight Qwen3.5-27B Q4_K_M file (`dflash bench make-gguf --shape qwen3.5-27b`) and a
random drafter of the published DFlash layout for that target (5 layers of the target's width, block 16, features
of target layers 1, 16, 31, 46 and 61; saved as a drafter folder, loaded as int8 rows as `--draft-weights auto`
does on a GPU). Then, in this process, with PyTorch's allocator capped so that it plus what lies outside it
(measured after CUDA starts: the context, and `--outside-gib` kept for cuBLAS and Triton's modules) stays within
`--cap-gib`:
* `load_engine(FILE, DRAFTER, weights=quantized)`, one request at a time, `--context` positions;
* one DDTree generation whose prompt fills the context (`--context` - `--gen` - 64 random tokens), then `--gen`
  tokens: prompt seconds (device-synchronised) and decode tokens/s;
* short-prompt decode speed, plain and DDTree (a random drafter: acceptance near one token, the cost side only).
Reports the allocator's peak, what the device had in use at the end beside it (`torch.cuda.mem_get_info`), and
their sum against the cap. An allocation past the cap fails the run (the figure is then an error, not a fit).

Usage: python benchmarks/gpu_hybrid_fit.py --out results/gpu_hybrid_fit_h100.json [--model FILE] [--drafter DIR]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from dflash.bench.provenance import provenance
from dflash.bench.random_gguf import write_random_gguf
from dflash.config import ModelConfig
from dflash.drafter.model import DFlashDrafter, DrafterConfig
from dflash.engine.engine import EngineOptions
from dflash.engine.loading import LoadOptions, load_engine
from dflash.generation.request import GenerationRequest
from dflash.generation.sampling import SamplingParams
from dflash.models.gguf_loader import open_gguf_model

GIB = 2**30
TARGET_LAYERS = [1, 16, 31, 46, 61]  # the published Qwen3.5-27B drafter's feature layers
PEAKS: list[tuple[int, int]] = []  # the allocator's peaks (allocated, reserved) before each generation


def largest_tensors(count: int = 20) -> list[str]:
    """The largest CUDA storages alive (shape, dtype, MiB), to see where the memory went."""
    import gc

    seen: dict[int, tuple[int, str]] = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.is_cuda:
            storage = obj.untyped_storage()
            seen[storage.data_ptr()] = (storage.nbytes(), f"{list(obj.shape)} {str(obj.dtype).removeprefix('torch.')}")
    ranked = sorted(seen.values(), reverse=True)[:count]
    return [f"{nbytes / 2**20:.0f} MiB {what}" for nbytes, what in ranked]


def make_drafter(config: ModelConfig, folder: Path) -> Path:
    """A random drafter of the published layout, written as a drafter folder (bf16)."""
    from dflash.training.export import export_drafter

    drafter_config = DrafterConfig(
        block_size=16, mask_token_id=config.vocab_size - 1, target_layer_ids=TARGET_LAYERS,
        num_target_layers=config.num_layers, hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size, num_layers=5, num_heads=32, num_kv_heads=8, head_dim=128,
        vocab_size=config.vocab_size, rope_theta=config.rope_theta, max_position_embeddings=262144,
    )
    with torch.device("cuda"):
        drafter = DFlashDrafter(drafter_config).to(torch.bfloat16)
    with torch.no_grad():
        for param in drafter.parameters():
            if param.dim() > 1:
                param.normal_(0.0, 0.02)
            else:
                param.fill_(1.0)  # norms
    export_drafter(drafter, folder)
    del drafter
    torch.cuda.empty_cache()
    return folder


def generate(engine: Any, tokens: int, new: int, spec: str, seed: int) -> dict[str, Any]:
    vocab = engine.target.config.vocab_size
    ids = torch.randint(10, vocab - 10, (tokens,), generator=torch.Generator().manual_seed(seed)).tolist()
    request = GenerationRequest(prompt_ids=ids, max_new_tokens=new, ignore_eos=True, use_prefix_cache=False,
                                sampling=SamplingParams(temperature=0.0))
    PEAKS.append((torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()))  # before this one
    torch.cuda.reset_peak_memory_stats()
    try:
        stats = engine.generate(request, spec=spec).stats
    finally:
        peak = torch.cuda.max_memory_allocated()
    return {
        "peak_allocated_gib": round(peak / GIB, 3),
        "prompt_tokens": stats.prompt_tokens, "prefill_s": round(stats.prefill_s, 3),
        "prefill_tok_s": round(stats.prompt_tokens / stats.prefill_s, 1),
        "completion_tokens": stats.completion_tokens, "decode_tok_s": round(stats.tokens_per_s, 2),
        "rounds": stats.rounds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=Path("/tmp/qwen3.5-27b-q4_k_m.gguf"))
    parser.add_argument("--drafter", type=Path, default=Path("/tmp/qwen3.5-27b-drafter"))
    parser.add_argument("--cap-gib", type=float, default=24.0)
    parser.add_argument("--outside-gib", type=float, default=0.75,
                        help="kept for memory outside PyTorch's allocator besides the context (cuBLAS, Triton)")
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--gen", type=int, default=128)
    parser.add_argument("--short", type=int, default=32)
    parser.add_argument("--no-cap", action="store_true", help="measure the peaks without capping the allocator")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    result: dict[str, Any] = {**provenance(torch.device("cuda")), "settings": {
        k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}}
    made = time.perf_counter()
    if not args.model.is_file():
        write_random_gguf(args.model, "qwen3.5-27b", "q4_k_m")
        result["make_gguf_s"] = round(time.perf_counter() - made, 1)
    result["file_gib"] = round(args.model.stat().st_size / GIB, 3)
    _, config, _, _ = open_gguf_model(args.model)
    if not (args.drafter / "config.json").is_file():
        make_drafter(config, args.drafter)
    torch.cuda.init()
    torch.empty(1, device="cuda")
    free, total = torch.cuda.mem_get_info()
    context = (total - free) / GIB
    allocator = args.cap_gib - context - args.outside_gib
    if not args.no_cap:
        torch.cuda.set_per_process_memory_fraction(allocator * GIB / total)
    result["memory"] = {"device_total_gib": round(total / GIB, 2), "context_gib": round(context, 3),
                        "allocator_cap_gib": round(allocator, 3)}
    print(json.dumps(result), flush=True)
    started = time.perf_counter()
    engine = load_engine(
        str(args.model), str(args.drafter), options=EngineOptions(max_batch=1, max_ctx=args.context),
        loading=LoadOptions(weights="quantized"),
    )
    result["load_s"] = round(time.perf_counter() - started, 1)
    result["loaded_gib"] = round(torch.cuda.memory_allocated() / GIB, 3)
    result["largest_after_load"] = largest_tensors()
    print("loaded", result["load_s"], result["loaded_gib"], *result["largest_after_load"], sep="\n", flush=True)
    runs: dict[str, Any] = {}
    try:
        engine.warm_up()
        runs["warm_plain"] = generate(engine, args.short, 16, "none", 1)
        runs["warm_ddtree"] = generate(engine, args.short, 16, "ddtree", 2)
        runs["plain"] = generate(engine, args.short, args.gen, "none", 3)
        runs["ddtree"] = generate(engine, args.short, args.gen, "ddtree", 4)
        print(json.dumps(runs), flush=True)
        runs["full_context_ddtree"] = generate(engine, args.context - args.gen - 64, args.gen, "ddtree", 5)
    except Exception as exc:  # an allocation past the cap: reported, with what was measured before it
        runs["error"] = f"{type(exc).__name__}: {exc}"[:600]
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    PEAKS.append((torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()))
    peak = max(reserved for _, reserved in PEAKS) / GIB
    result["largest_at_end"] = largest_tensors()
    outside = (total - free) / GIB - torch.cuda.memory_reserved() / GIB
    result["runs"] = runs
    result["memory"].update(
        peak_allocated_gib=round(max(allocated for allocated, _ in PEAKS) / GIB, 3),
        peak_reserved_gib=round(peak, 3),
        outside_allocator_at_end_gib=round(outside, 3), peak_device_gib=round(peak + outside, 3),
        within_cap=bool(peak + outside <= args.cap_gib and "error" not in runs),
    )
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1), flush=True)


if __name__ == "__main__":
    main()
