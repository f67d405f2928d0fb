"""DFlash rounds with the drafter beside the target or on a second GPU (`--draft-device`), in one run.

A Qwen3-32B-shaped target with random bf16 weights on GPU 0 and a drafter of five layers of the target's shape
(block 16, five target layers' features, random weights) decode greedily through the engine (CUDA graphs, fused
layers), 1,024 prompt tokens then `--tokens` new ones, for each placement:
* `same`: the drafter on GPU 0, as the engine runs it by default (greedy rounds as device-resident replays);
* `same_host_loop`: the drafter on GPU 0 but driven like a split one (`DraftDeviceForwards` with the copies on GPU
  0): the host loop runs every round, which isolates what the second GPU itself costs;
* `split`: the drafter, its cache and copies of the target's embedding and LM head on GPU 1.
Random weights accept almost no drafts, so every round commits about one token: `round_ms` (decode time / rounds)
is the cost of one draft + verify cycle, which is what the placement changes; acceptance is not measured here.
Also GPU 0's peak memory per placement (the memory a split drafter gives back to the target).

Usage:  PYTHONPATH=src python3 benchmarks/gpu_draft_device.py --out results/gpu_draft_device_h100.json
        PYTHONPATH=src python benchmarks/gpu_draft_device.py --tiny --out /tmp/dd.json   (CPU logic check)
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import platform
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
from gpu_scale_study import randomise  # benchmarks/ is the script's folder
from gpu_tensor_parallel import capture_layers, qwen3_32b_config, random_target, tiny_config

from dflash.config import ModelConfig
from dflash.drafter.borrowed_heads import BorrowedHeads
from dflash.drafter.model import DFlashDrafter, DrafterConfig
from dflash.engine.engine import Engine, EngineOptions
from dflash.generation.draft_device import DraftDeviceForwards
from dflash.generation.forwards import forwards_for, register_forwards
from dflash.generation.request import GenerationRequest

PROMPT_TOKENS = 1024
REPEATS = 3


class CountingTokenizer:
    """Just what the engine reads of a tokenizer for token-id prompts: no EOS, one character per token."""

    eos_token_ids: tuple[int, ...] = ()
    bos_token_id = None
    add_bos = False

    def decode(self, ids: list[int]) -> str:
        return "x" * len(ids)


def drafter_config(config: ModelConfig) -> DrafterConfig:
    return DrafterConfig(
        block_size=16, mask_token_id=config.vocab_size - 1, target_layer_ids=capture_layers(config),
        num_target_layers=config.num_layers, hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size, num_layers=5 if config.num_layers > 8 else 1,
        num_heads=config.num_heads, num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
        vocab_size=config.vocab_size, rope_theta=config.rope_theta, max_position_embeddings=8192,
    )


def random_drafter(config: ModelConfig, device: torch.device, dtype: torch.dtype) -> DFlashDrafter:
    with torch.device("meta"):
        drafter = DFlashDrafter(drafter_config(config))
    drafter = drafter.to(dtype).to_empty(device=device)
    randomise(drafter)
    return drafter.eval().requires_grad_(False)


def run_placement(
    placement: str, target: Any, config: ModelConfig, dtype: torch.dtype, spec: str, tokens: int,
    devices: tuple[torch.device, torch.device],
) -> dict[str, Any]:
    """Decode `REPEATS` times with the drafter placed as `placement` -> round and token times, peak memory."""
    first, second = devices
    drafter = random_drafter(config, second if placement == "split" else first, dtype)
    if first.type == "cuda":
        torch.cuda.reset_peak_memory_stats(first)
    engine = Engine(target, CountingTokenizer(), drafter,  # type: ignore[arg-type]
                    EngineOptions(spec=spec, max_ctx=PROMPT_TOKENS + tokens + 64, max_batch=1, prefix_cache_mb=0))
    if placement == "same_host_loop":
        register_forwards(target, DraftDeviceForwards(forwards_for(target), BorrowedHeads(target, first), first))
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, config.vocab_size - 1, (PROMPT_TOKENS,), generator=generator).tolist()
    request = GenerationRequest(prompt_ids=prompt, max_new_tokens=tokens, ignore_eos=True, use_prefix_cache=False)
    try:
        engine.generate(request, spec=spec)  # warm-up: captures the graphs of the measured shapes
        runs = []
        for _ in range(REPEATS):
            stats = engine.generate(request, spec=spec).stats
            runs.append({
                "round_ms": round(1e3 * stats.decode_s / max(1, stats.rounds), 3),
                "tok_s": round(stats.completion_tokens / stats.decode_s, 1),
                "rounds": stats.rounds, "tokens": stats.completion_tokens,
                "accepted_per_round": round(stats.accepted_tokens / max(1, stats.rounds), 3),
            })
        out: dict[str, Any] = {
            "round_ms": statistics.median(r["round_ms"] for r in runs),
            "tok_s": statistics.median(r["tok_s"] for r in runs),
            "runs": runs,
            "drafter_device": str(drafter.fc.weight.device),
        }
        if first.type == "cuda":
            out["gpu0_peak_gib"] = round(torch.cuda.max_memory_allocated(first) / 2**30, 2)
            if placement == "split":
                out["gpu1_peak_gib"] = round(torch.cuda.max_memory_allocated(second) / 2**30, 2)
        return out
    finally:
        engine.close()
        register_forwards(target, None)
        del engine, drafter
        gc.collect()
        if first.type == "cuda":
            torch.cuda.empty_cache()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--tiny", action="store_true", help="a toy shape on the CPU (checks the script's logic)")
    parser.add_argument("--tokens", type=int, default=128, help="new tokens per generation")
    parser.add_argument("--specs", default="linear,ddtree")
    args = parser.parse_args()
    cuda = not args.tiny
    first = torch.device("cuda", 0) if cuda else torch.device("cpu")
    second = torch.device("cuda", 1) if cuda and torch.cuda.device_count() > 1 else first
    dtype = torch.bfloat16 if cuda else torch.float32
    config = tiny_config() if args.tiny else qwen3_32b_config()
    placements = ["same", "same_host_loop"] + (["split"] if second != first else [])
    report: dict[str, Any] = {
        "benchmark": "gpu_draft_device",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "shape": {"target_hidden": config.hidden_size, "target_layers": config.num_layers,
                  "vocab": config.vocab_size, "drafter": drafter_config(config).__dict__ | {"target_layer_ids": list(
                      capture_layers(config))}, "dtype": str(dtype).removeprefix("torch.")},
        "prompt_tokens": PROMPT_TOKENS, "new_tokens": args.tokens, "repeats": REPEATS,
        "environment": {
            "torch": torch.__version__, "python": platform.python_version(),
            "cuda": torch.version.cuda if cuda else None,
            "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else ["cpu"],
        },
        "notes": "round_ms: decode time / rounds (random weights: ~0 drafts accepted, one token per round), median "
                 f"of {REPEATS} generations; same: drafter on GPU 0 (device-resident rounds); same_host_loop: "
                 "drafter on GPU 0 through the split path's host loop; split: drafter on GPU 1.",
        "results": {},
    }
    out_path = Path(args.out)
    target = random_target(config, first, dtype, None, seed=0)
    for spec in args.specs.split(","):
        for placement in placements:
            try:
                result = run_placement(placement, target, config, dtype, spec, args.tokens, (first, second))
            except Exception as exc:  # one failing placement is reported, the others still run
                result = {"error": f"{type(exc).__name__}: {exc}"[:500]}
            report["results"][f"{spec}_{placement}"] = result
            print(spec, placement, json.dumps(result), flush=True)
            out_path.parent.mkdir(parents=True, exist_ok=True)
            out_path.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
