"""The default model's quantized matrix chain (every matrix of one forward, LM head included) on each CPU
products kernel, at 1, 5 and 16 input rows: what a plain step, a DDTree verification of 4 nodes and one of 15
nodes cost in the products alone.

    python benchmarks/cpu_matmul_chain.py --out results/cpu_matmul_chain.json
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch

from dflash.bench.provenance import provenance, write_result
from dflash.engine.loading import LoadOptions, load_engine
from dflash.models.cpu_matmul import amx_obstacle
from dflash.models.quantized_layers import QuantizedLinear

ROWS = (1, 5, 16)


def chain_ms(matrices: list[QuantizedLinear], rows: int, repeats: int) -> float:
    inputs = [torch.randn(rows, m.in_features) for m in matrices]
    for _ in range(3):
        for matrix, x in zip(matrices, inputs, strict=True):
            matrix(x)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        for matrix, x in zip(matrices, inputs, strict=True):
            matrix(x)
        best = min(best, time.perf_counter() - started)
    return round(best * 1000, 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=20, help="chains per figure (the best is kept)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    kinds = ["float32"] if amx_obstacle() is not None else ["float32", "amx"]
    engine = load_engine("default", "none", loading=LoadOptions(device="cpu", cpu_matmul="float32"))
    matrices = [m for m in engine.target.modules() if isinstance(m, QuantizedLinear)]
    figures: dict[str, Any] = {}
    with torch.inference_mode():
        for kind in kinds:
            for matrix in matrices:
                matrix.use_products(kind)
            per_rows = {f"{rows}_rows_ms": chain_ms(matrices, rows, args.repeats) for rows in ROWS}
            per_rows["16_rows_over_1_row"] = round(per_rows["16_rows_ms"] / per_rows["1_rows_ms"], 2)
            figures[kind] = per_rows
            print(kind, per_rows)
    result: dict[str, Any] = {
        **provenance(engine.device),
        "command": f"python benchmarks/cpu_matmul_chain.py --repeats {args.repeats}",
        "model": engine.model_name,
        "matrices": len(matrices),
        "amx": amx_obstacle() or "available",
        "figures": figures,
    }
    write_result(result, args.out)


if __name__ == "__main__":
    main()
