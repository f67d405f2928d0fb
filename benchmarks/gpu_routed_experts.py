"""The routed-expert programs (`dflash.kernels.triton_experts`) against the grouped product, one mixture layer's
experts at a time at the Qwen3-30B-A3B shape (128 experts of width 768, hidden 2048, top 8), random bf16 weights:
GPU time per layer call (eight layers' calls replayed as one CUDA graph) for 1, 2 and 4 tokens, over a sweep of
the programs' blocks and warps, and the floor (the chosen
experts' bytes over the measured copy bandwidth). Eight layers' stacks are used in turn, each token choosing its
own random experts, so no call finds its experts in L2 from the previous one.

Usage: python benchmarks/gpu_routed_experts.py --out results/gpu_routed_experts_h100.json
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path
from typing import Any

import torch
from gpu_scale_study import as_graph, copy_bandwidth, median_ms  # benchmarks/ is on the path

from dflash.bench.provenance import provenance
from dflash.kernels.triton_experts import routed_experts
from dflash.models.moe import StackedExperts

EXPERTS, HIDDEN, WIDTH, TOP_K, LAYERS = 128, 2048, 768, 8, 8


def time_tokens(
    stacks: list[StackedExperts], tokens: int, generator: torch.Generator, bandwidth: float
) -> dict[str, Any]:
    """Per-layer microseconds of the grouped product and of every block choice of the routed programs."""
    device = stacks[0].gate_up_proj.device
    chosen = [torch.stack([torch.randperm(EXPERTS, generator=generator)[:TOP_K] for _ in range(tokens)]).to(device)
              for _ in range(LAYERS)]
    x = torch.randn(tokens, HIDDEN, device=device, dtype=torch.bfloat16)
    weights = torch.full((tokens, TOP_K), 1.0 / TOP_K, device=device, dtype=torch.bfloat16)
    distinct = chosen[0].flatten().unique().numel()
    row: dict[str, Any] = {"floor_us": round(distinct * 3 * WIDTH * HIDDEN * 2 / bandwidth * 1e6, 2)}

    def grouped() -> None:
        for layer in range(LAYERS):
            stacks[layer].grouped(x, chosen[layer], weights)

    def routed(blocks: tuple[int, int, int, int, int]) -> None:
        for layer in range(LAYERS):
            stack = stacks[layer]
            routed_experts(x, chosen[layer], weights, stack.gate_up_proj, stack.down_proj, blocks=blocks)

    with torch.inference_mode():
        row["grouped_us"] = round(median_ms(as_graph(grouped), iters=20) * 1e3 / LAYERS, 2)
        best: tuple[float, tuple[int, int, int, int, int]] | None = None
        for blocks in itertools.product((4, 8), (2, 4, 8), (512, 1024), (64, 128, 256), (4, 8)):
            timed = median_ms(as_graph(lambda blocks=blocks: routed(blocks)), iters=20) * 1e3 / LAYERS
            row["routed_{}_{}_{}_{}_{}_us".format(*blocks)] = round(timed, 2)
            if best is None or timed < best[0]:
                best = (timed, blocks)
        assert best is not None
        row["best_routed"] = {"us": round(best[0], 2), "blocks": list(best[1])}
        reference = stacks[0].grouped(x, chosen[0], weights)
        check = routed_experts(x, chosen[0], weights, stacks[0].gate_up_proj, stacks[0].down_proj, blocks=best[1])
        row["max_abs_difference_to_grouped"] = float((check.float() - reference.float()).abs().max())
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    device = torch.device("cuda")
    stacks = []
    for _ in range(LAYERS):
        experts = StackedExperts(EXPERTS, HIDDEN, WIDTH, "silu").to(device, torch.bfloat16)
        with torch.no_grad():
            experts.gate_up_proj.normal_(0.0, 0.02)
            experts.down_proj.normal_(0.0, 0.02)
        stacks.append(experts)
    bandwidth = copy_bandwidth(device)
    out: dict[str, Any] = {"copy_bandwidth_gbps": round(bandwidth / 1e9, 1), "rows": {}}
    generator = torch.Generator().manual_seed(0)
    for tokens in (1, 2, 4):
        row = time_tokens(stacks, tokens, generator, bandwidth)
        out["rows"][str(tokens)] = row
        print(tokens, json.dumps(row["best_routed"]), row["grouped_us"], row["floor_us"], flush=True)
    out["provenance"] = provenance(device)
    args.out.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
