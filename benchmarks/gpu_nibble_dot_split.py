"""The tensor-core word product (`nibble_dot`, 5-64 rows: verifications, trees, the drafter's block through the
LM head) on the matrices of a Qwen3.5-27B Q4_K_M file, whole reductions against split ones, and a small grid of
configurations: microseconds per product and the weight bytes streamed per second.

Usage: python benchmarks/gpu_nibble_dot_split.py --out results/FILE.json
"""

from __future__ import annotations

import argparse
import itertools
import json
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gpu_scale_study import median_ms  # benchmarks/ is on the path

from dflash.bench.provenance import provenance
from dflash.bench.random_gguf import random_blocks
from dflash.kernels.gguf_nibbles import nibble_matrix
from dflash.kernels.triton_gguf_int8 import dot_splits, nibble_dot

Q4_K, Q6_K = GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K
# Qwen3.5-27B: (name, rows n, columns k, format)
MATRICES = [
    ("linear_in_joint", 16480, 5120, Q4_K),
    ("linear_out", 5120, 6144, Q4_K),
    ("gate_up", 34816, 5120, Q4_K),
    ("down", 5120, 17408, Q4_K),
    ("down_q6", 5120, 17408, Q6_K),
    ("lm_head_q6", 248320, 5120, Q6_K),
]


def time_us(run: Any) -> float:
    return median_ms(run, iters=20) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="16,33,64")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    device = torch.device("cuda")
    rng = np.random.default_rng(0)
    result: dict[str, Any] = {**provenance(device), "matrices": {}}
    for name, n, k, qtype in MATRICES:
        blocks = torch.from_numpy(random_blocks(n, k, qtype, rng)).to(device)
        matrix = nibble_matrix(blocks, qtype, k)
        del blocks
        nbytes = matrix.nbytes
        entry: dict[str, Any] = {"n": n, "k": k, "format": qtype.name, "mb": round(nbytes / 1e6, 1)}
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
            out = torch.empty(rows, n, device=device, dtype=torch.bfloat16)
            timings: dict[str, float] = {}
            timings["default"] = time_us(partial(nibble_dot, x, matrix, out=out))
            timings["unsplit"] = time_us(partial(nibble_dot, x, matrix, out=out, splits=1))
            for block_n, step, warps in itertools.product((32, 64, 128), (4, 8), (4, 8)):
                if block_n == 128 and rows == 64 and warps == 4:
                    continue
                label = f"bn{block_n}_gs{step}_w{warps}"
                try:
                    timings[label] = time_us(partial(nibble_dot, x, matrix, out=out, block_n=block_n,
                                                     group_step=step, warps=warps))
                except Exception as exc:  # a configuration the compiler refuses: noted, not fatal
                    timings[label] = float("nan")
                    print(label, type(exc).__name__, str(exc)[:120], flush=True)
            best = min((v, key) for key, v in timings.items() if v == v)
            entry[f"rows_{rows}"] = {
                "us": {key: round(v, 1) for key, v in timings.items()},
                "splits_default": dot_splits(-(-n // 128), k // 32 // 4, device),
                "default_gb_s": round(nbytes / timings["default"] / 1e3, 1),
                "unsplit_gb_s": round(nbytes / timings["unsplit"] / 1e3, 1),
                "best": best[1], "best_gb_s": round(nbytes / best[0] / 1e3, 1),
            }
            print(name, rows, json.dumps(entry[f"rows_{rows}"]), flush=True)
        result["matrices"][name] = entry
        torch.cuda.empty_cache()
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
