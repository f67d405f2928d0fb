"""A Qwen3-30B-A3B-shaped mixture (random bf16 weights) through the engine's graph runner, its routing and routed
experts through the few-token Triton programs (`dflash.kernels.triton_experts`) and, as the baseline, through
torch's routing operations and the grouped product, in one run on one GPU: graphed one-token step, 4-row and 16-row verifications, 32-node tree, after `--context` cached
positions; the weight-streaming floor beside them (the chosen experts' bytes, attention, routers and head over the
measured copy bandwidth).

Usage: python benchmarks/gpu_moe_step.py --out results/gpu_moe_step_h100.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
from gpu_family_scale_study import (  # benchmarks/ is on the path
    build,
    engine_forward,
    model_configs,
    token_bytes,
)
from gpu_scale_study import copy_bandwidth, median_ms

from dflash.bench.provenance import provenance
from dflash.fastpath.runner import MAX_GRAPH_ROWS, GraphRunner
from dflash.kernels import triton_experts

SHAPES = {"step_1": (1, False), "verify_4": (4, False), "verify_16": (16, False), "tree_32": (32, True)}


def kernel_profile(step: Any, steps: int = 5) -> list[dict[str, Any]]:
    """The GPU kernels of `steps` replays of a step, by total time: name, launches and microseconds per step."""
    step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    events.sort(key=lambda e: e.device_time_total, reverse=True)
    return [
        {"kernel": e.key[:120], "per_step": e.count // steps, "us_per_step": round(e.device_time_total / steps, 1)}
        for e in events[:20]
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    device = torch.device("cuda")
    config = model_configs(args.layers)["qwen3-30b-a3b"]
    model = build(config, device)
    bandwidth = copy_bandwidth(device)
    out: dict[str, Any] = {
        "model": "qwen3-30b-a3b shape, random bf16", "layers": config.num_layers, "context": args.context,
        "copy_bandwidth_gbps": round(bandwidth / 1e9, 1),
        "floor_step_ms": round(token_bytes(model) / bandwidth * 1e3, 3),
    }
    limit = triton_experts.ROUTED_MAX_TOKENS
    with torch.inference_mode():
        for label, routed in (("grouped", 0), ("routed", 4), ("routed_16", 16)):
            # read when a graph is captured: a runner of its own each; the baseline routes with torch's operations too
            triton_experts.ROUTED_MAX_TOKENS, triton_experts.ROUTE_PROGRAM = routed, routed > 0
            runner = GraphRunner(model, None, args.context + 2 * MAX_GRAPH_ROWS)
            runner.target_storage.keys.normal_()
            runner.target_storage.values.normal_()
            runner.target_storage.positions[0, : args.context] = torch.arange(args.context, device=device)
            out[f"{label}_fused_layers"] = runner.fused
            for shape, (tokens, tree) in SHAPES.items():
                timed = median_ms(engine_forward(runner, args.context, tokens, tree), iters=20)
                out[f"{shape}_{label}_ms"] = round(timed, 3)
            out[f"step_1_{label}_kernels"] = kernel_profile(engine_forward(runner, args.context, 1, False))
            del runner
            torch.cuda.empty_cache()
    triton_experts.ROUTED_MAX_TOKENS, triton_experts.ROUTE_PROGRAM = limit, True
    out["step_routed_over_floor"] = round(out["step_1_routed_ms"] / out["floor_step_ms"], 2)
    out["provenance"] = provenance(device)
    print(json.dumps(out), flush=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
