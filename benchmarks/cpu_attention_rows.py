"""The fused CPU attention and greedy argmax against torch's own operations, at the shapes of the default model.

Attention: 9 query heads over 3 key heads of 64 values, 400 cached keys, 1 / 5 / 9 / 16 query rows (a plain step,
DDTree verifications of 4, 8 and 15 nodes), the kernel (`cpu_layer_ops.attention`) beside SDPA. Argmax: 1 and 9
rows of 49,152 logits, `argmax_rows` beside `torch.argmax`. Best of 3 x 500 calls each, in one process.

    python benchmarks/cpu_attention_rows.py --out results/cpu_attention_rows.json
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from dflash.bench.provenance import provenance, write_result
from dflash.kernels.build import load_layer_ops


def best_us(call: Callable[..., Any], *args: Any, repeats: int = 500, **kwargs: Any) -> float:
    """Best of 3 x `repeats` calls of call(*args, **kwargs), in microseconds per call."""
    for _ in range(50):
        call(*args, **kwargs)
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        for _ in range(repeats):
            call(*args, **kwargs)
        best = min(best, (time.perf_counter() - started) / repeats * 1e6)
    return round(best, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keys", type=int, default=400)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    ops = load_layer_ops()
    torch.manual_seed(0)
    figures: dict[str, Any] = {"attention_us": {}, "argmax_us": {}}
    keys = torch.randn(1, 3, args.keys, 64)
    values = torch.randn(1, 3, args.keys, 64)
    for rows in (1, 5, 9, 16):
        q = torch.randn(1, 9, rows, 64)
        mask = torch.ones(1, 1, rows, args.keys, dtype=torch.bool).tril(args.keys - rows)  # the new rows causal
        figures["attention_us"][f"{rows}_rows"] = {
            "kernel": best_us(ops.attention, q, keys, values, mask, 0.125),
            "sdpa": best_us(F.scaled_dot_product_attention, q, keys, values, attn_mask=mask, scale=0.125,
                            enable_gqa=True),
        }
    for rows in (1, 9) if hasattr(ops, "argmax_rows") else ():  # (a kernel built from an older source has none)
        logits = torch.randn(rows, 49152)
        figures["argmax_us"][f"{rows}_rows"] = {
            "kernel": best_us(ops.argmax_rows, logits),
            "torch": best_us(torch.argmax, logits, dim=-1),
        }
    result = {**provenance(torch.device("cpu")), "command": f"python benchmarks/cpu_attention_rows.py --keys {args.keys}",
              "threads": torch.get_num_threads(), "figures": figures}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
    write_result(result, args.out)


if __name__ == "__main__":
    main()
