"""The padded step's attention, the key gather + SDPA against the paged program, by shape, on one GPU.

For each model shape (the default model's: 9 heads / 3 key-value heads of 64; a Qwen3-8B's: 32 / 8 of 128), each
request count, rows per request and keys bucket, a real `PaddedBatch` is loaded over a `BlockPool` whose requests'
blocks are interleaved (as concurrent requests leave them), and one layer's attention is timed both ways, as the
fused padded pass runs it: `keys[:, read_slots]` and `values[:, read_slots]` gathered for one masked SDPA, its
output laid out as rows for the output product; or `paged_attention` over the pool in place (its output already
laid out so). Each is captured in a CUDA graph that attends over `--layers` layers of the pool in turn (so that the
keys are not all in L2 as in a one-layer loop) and reported per layer (bf16). Requests fill their keys bucket
(`full`: the paged program's worst case) or hold between half and all of it (`mixed`: what bucketing leaves; the
program stops at each request's last key). The paged program is first checked against the gather on the same batch.

Usage: PYTHONPATH=src python benchmarks/gpu_paged_attention.py --out results/gpu_paged_attention_h100.json
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from gpu_round_profile import graph_gpu_ms  # benchmarks/ is the script's folder

from dflash.batch.padded import PaddedBatch, PaddedShape
from dflash.batch.pool import BlockPool, SlotTable
from dflash.batch.target_pass import TargetRows
from dflash.bench.provenance import provenance
from dflash.kernels.triton_paged_attention import paged_attention

SHAPES = {"smollm2-135m": (9, 3, 64), "qwen3-8b": (32, 8, 128)}  # heads, key-value heads, head_dim
BLOCK_TOKENS = 16  # the engine's pool block (`dflash.batch.core.POOL_BLOCK_TOKENS`)
DTYPE = torch.bfloat16


def loaded_batch(
    requests: int, rows: int, keys: int, kv_heads: int, head_dim: int, layers: int, fill: str, seed: int,
    device: torch.device, dtype: torch.dtype = DTYPE,
) -> tuple[BlockPool, PaddedBatch]:
    """A pool of random K/V whose `requests` tables are reserved block by block in turn (interleaved blocks), each
    with `rows` causal new rows after its committed keys, loaded and derived into a batch of that shape."""
    generator = torch.Generator().manual_seed(seed)
    pool = BlockPool(layers, kv_heads, head_dim, requests * keys // BLOCK_TOKENS + 1, BLOCK_TOKENS, dtype=dtype,
                     device=device)
    torch.manual_seed(seed)
    pool.keys.normal_()  # on the device: a CPU copy of an 8B-shaped pool would take a while
    pool.values.normal_()
    if fill == "full":
        totals = [keys] * requests
    else:  # between half the bucket and all of it
        totals = torch.randint(keys // 2 + 1, keys + 1, (requests,), generator=generator).tolist()
    tables = [SlotTable(pool) for _ in range(requests)]
    for end in range(BLOCK_TOKENS, keys + BLOCK_TOKENS, BLOCK_TOKENS):
        for table, total in zip(tables, totals, strict=True):
            table.reserve(min(end, total))
    items = []
    for table, total in zip(tables, totals, strict=True):
        past = total - rows
        table.crop(past)
        tokens = torch.zeros(rows, dtype=torch.long)
        items.append(TargetRows(table, tokens, torch.arange(past, total)))
    batch = PaddedBatch(PaddedShape(requests, rows, keys), pool, None)
    batch.load(items)
    batch.derive()
    return pool, batch


def attention_paths(
    pool: BlockPool, batch: PaddedBatch, q: torch.Tensor, scale: float
) -> tuple[Callable[[], list[torch.Tensor]], Callable[[], list[torch.Tensor]]]:
    """The gather + SDPA path and the paged path over every layer of the pool -> each layer's [requests * rows,
    heads * head_dim] output (as the output product reads it)."""
    requests, heads, rows, _ = q.shape
    kv_heads = pool.keys.shape[1]
    additive = batch.additive_mask(q.dtype)  # built once per step by the pass: not timed
    read = batch.read_slots

    def gather() -> list[torch.Tensor]:
        outs = []
        for keys, values in zip(pool.keys, pool.values, strict=True):
            out = F.scaled_dot_product_attention(
                q, keys[:, read].transpose(0, 1), values[:, read].transpose(0, 1), attn_mask=additive, scale=scale,
                enable_gqa=heads != kv_heads,
            )
            outs.append(out.transpose(1, 2).reshape(requests * rows, -1))
        return outs

    def paged() -> list[torch.Tensor]:
        outs = []
        for keys, values in zip(pool.keys, pool.values, strict=True):
            out = paged_attention(q, keys, values, read, batch.past, batch.counts, batch.visibility, scale)
            outs.append(out.transpose(1, 2).reshape(requests * rows, -1))
        return outs

    return gather, paged


def time_shape(
    heads: int, kv_heads: int, head_dim: int, requests: int, rows: int, keys: int, layers: int
) -> dict[str, float]:
    """Device ms per layer of the gather + SDPA and of the paged program (both fills), and their ratios."""
    timing: dict[str, float] = {}
    scale = head_dim**-0.5
    for fill in ("full", "mixed"):
        pool, batch = loaded_batch(requests, rows, keys, kv_heads, head_dim, layers, fill, requests * keys + rows,
                                   torch.device("cuda"))
        generator = torch.Generator().manual_seed(rows)
        q = torch.randn((requests, heads, rows, head_dim), generator=generator).to("cuda", DTYPE)
        gather, paged = attention_paths(pool, batch, q, scale)
        for expected, got in zip(gather(), paged(), strict=True):
            torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2)
        if fill == "full":  # the gather's work does not depend on the requests' lengths
            timing["gather_ms"] = round(graph_gpu_ms(gather) / layers, 4)
        timing[f"paged_{fill}_ms"] = round(graph_gpu_ms(paged) / layers, 4)
        timing[f"paged_{fill}_over_gather"] = round(timing[f"paged_{fill}_ms"] / timing["gather_ms"], 3)
        del pool, batch
    return timing


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", default="1,2,4,8,16")
    parser.add_argument("--rows", default="1,16,32")
    parser.add_argument("--keys", default="512,1024,2048,4096")
    parser.add_argument("--shapes", default="smollm2-135m,qwen3-8b", help=f"of {', '.join(SHAPES)}")
    parser.add_argument("--layers", type=int, default=8, help="pool layers each graph attends over in turn")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    table: dict[str, Any] = {}
    print(f"{'shape':14} {'req':>4} {'rows':>4} {'keys':>5} {'gather':>8} {'paged full':>10} {'paged mixed':>11}")
    for name in args.shapes.split(","):
        heads, kv_heads, head_dim = SHAPES[name]
        for keys in (int(k) for k in args.keys.split(",")):
            for requests in (int(r) for r in args.requests.split(",")):
                for rows in (int(r) for r in args.rows.split(",")):
                    timing = time_shape(heads, kv_heads, head_dim, requests, rows, keys, args.layers)
                    table[f"{name}/keys{keys}/requests{requests}/rows{rows}"] = timing
                    print(f"{name:14} {requests:4} {rows:4} {keys:5} {timing['gather_ms']:8.4f} "
                          f"{timing['paged_full_ms']:10.4f} {timing['paged_mixed_ms']:11.4f}", flush=True)
    result = {**provenance(torch.device("cuda")), "shapes": {name: SHAPES[name] for name in args.shapes.split(",")},
              "layers": args.layers, "dtype": str(DTYPE), "attention_ms_per_layer": table}
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
