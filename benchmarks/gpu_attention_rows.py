"""Attention alone, SDPA against the split-key program, by query rows and context length, on one GPU.

For each model shape (the default model's: 9 heads / 3 key-value heads of 64; a Qwen3-8B's: 32 / 8 of 128), each
number of query rows (one-row steps, verifications, tree verifications, prefill chunks) and each context length,
the device time of one layer's attention over a static cache under a causal mask, both ways, each captured alone
in a CUDA graph (bf16). The split-key program is first checked against SDPA on the same inputs. The fused target
forward uses the program for multi-row forwards up to `SPLIT_MAX_ROWS` rows; this table is where that rule comes
from.

Usage: PYTHONPATH=src python benchmarks/gpu_attention_rows.py --out results/gpu_attention_rows_h100.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from gpu_round_profile import graph_gpu_ms  # benchmarks/ is the script's folder

from dflash.bench.provenance import provenance
from dflash.kernels.triton_attention import few_row_attention

# heads, key-value heads, head_dim (a 32B rank under two-way tensor parallelism: half the heads)
SHAPES = {
    "smollm2-135m": (9, 3, 64), "qwen3-8b": (32, 8, 128), "qwen3-32b": (64, 8, 128), "qwen3-32b-tp2": (32, 4, 128),
}


def time_shape(
    heads: int, kv_heads: int, head_dim: int, rows: int, context: int, slices: tuple[int, ...] = ()
) -> dict[str, float]:
    """Device ms of SDPA and of the split-key program for `rows` new rows after `context - rows` cached ones; with
    `slices`, also the program with each of these shortest key slices (`split_slice<N>_ms`)."""
    device = torch.device("cuda")
    generator = torch.Generator().manual_seed(rows + context)
    q = torch.randn((rows, heads, head_dim), generator=generator).to(device, torch.bfloat16)
    keys = torch.randn((kv_heads, context, head_dim), generator=generator).to(device, torch.bfloat16)
    values = torch.randn((kv_heads, context, head_dim), generator=generator).to(device, torch.bfloat16)
    visible = torch.ones((rows, context), dtype=torch.bool, device=device).tril(context - rows)
    additive = torch.zeros((rows, context), dtype=torch.bfloat16, device=device).masked_fill_(~visible, float("-inf"))
    scale = head_dim**-0.5
    q_heads = q.transpose(0, 1)[None]  # [1, heads, rows, head_dim]

    def sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(
            q_heads, keys[None], values[None], attn_mask=additive, scale=scale, enable_gqa=heads != kv_heads
        )[0].transpose(0, 1)

    def split() -> torch.Tensor:
        return few_row_attention(q, keys, values, additive, context, scale)

    torch.testing.assert_close(split(), sdpa(), rtol=2e-2, atol=2e-2)
    timing = {"sdpa_ms": round(graph_gpu_ms(sdpa), 4), "split_ms": round(graph_gpu_ms(split), 4)}
    for shortest in slices:
        def sliced(shortest: int = shortest) -> torch.Tensor:
            return few_row_attention(q, keys, values, additive, context, scale, min_slice=shortest)

        torch.testing.assert_close(sliced(), sdpa(), rtol=2e-2, atol=2e-2)
        timing[f"split_slice{shortest}_ms"] = round(graph_gpu_ms(sliced), 4)
    return timing


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,2,8,16,40,72,128")
    parser.add_argument("--contexts", default="512,2048,8192,16384")
    parser.add_argument("--shapes", default="smollm2-135m,qwen3-8b", help=f"of {', '.join(SHAPES)}")
    parser.add_argument("--slices", default="", help="also time these shortest key slices, e.g. 64,128")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    slices = tuple(int(s) for s in args.slices.split(",") if s)
    table: dict[str, Any] = {}
    for name in args.shapes.split(","):
        heads, kv_heads, head_dim = SHAPES[name]
        for context in (int(c) for c in args.contexts.split(",")):
            for rows in (int(r) for r in args.rows.split(",")):
                timing = time_shape(heads, kv_heads, head_dim, rows, context, slices)
                timing["split_over_sdpa"] = round(timing["split_ms"] / timing["sdpa_ms"], 3)
                table[f"{name}/ctx{context}/rows{rows}"] = timing
                print(name, context, rows, timing, flush=True)
    result = {**provenance(torch.device("cuda")), "shapes": {name: SHAPES[name] for name in args.shapes.split(",")},
              "attention_ms": table}
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
