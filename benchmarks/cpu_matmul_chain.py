"""The default model's quantized matrix chain (every matrix of one forward, LM head included) on each CPU
products kernel (float32, AMX where the CPU has it, int8 where it builds), at 1, 5 and 16 input rows: what a plain
step, a DDTree verification of 4 nodes and one of 15 nodes cost in the products alone. The kernels take turns
chain by chain (interleaved), so a change in the machine's load moves every kernel's figures alike.

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
from dflash.models.cpu_matmul import amx_obstacle, int8_obstacle
from dflash.models.quantized_layers import QuantizedLinear

ROWS = (1, 5, 16)


def chain_seconds(matrices: list[QuantizedLinear], inputs: list[torch.Tensor], kind: str) -> float:
    for matrix in matrices:
        matrix.use_products(kind)
    started = time.perf_counter()
    for matrix, x in zip(matrices, inputs, strict=True):
        matrix(x)
    return time.perf_counter() - started


def chains_ms(matrices: list[QuantizedLinear], kinds: list[str], rows: int, repeats: int) -> dict[str, float]:
    """kind -> best chain of `repeats` in ms, the kinds interleaved chain by chain (3 warm-up chains each)."""
    inputs = [torch.randn(rows, m.in_features) for m in matrices]
    best = dict.fromkeys(kinds, float("inf"))
    for repeat in range(repeats + 3):
        for kind in kinds:
            seconds = chain_seconds(matrices, inputs, kind)
            if repeat >= 3:
                best[kind] = min(best[kind], seconds)
    return {kind: round(seconds * 1000, 2) for kind, seconds in best.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=20, help="chains per figure (the best is kept)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    kinds = ["float32"] + ([] if amx_obstacle() else ["amx"]) + ([] if int8_obstacle() else ["int8"])
    engine = load_engine("default", "none", loading=LoadOptions(device="cpu", cpu_matmul="float32"))
    matrices = [m for m in engine.target.modules() if isinstance(m, QuantizedLinear)]
    figures: dict[str, Any] = {kind: {} for kind in kinds}
    with torch.inference_mode():
        for rows in ROWS:
            for kind, ms in chains_ms(matrices, kinds, rows, args.repeats).items():
                figures[kind][f"{rows}_rows_ms"] = ms
    for kind, per_rows in figures.items():
        per_rows["16_rows_over_1_row"] = round(per_rows["16_rows_ms"] / per_rows["1_rows_ms"], 2)
        print(kind, per_rows)
    result: dict[str, Any] = {
        **provenance(engine.device),
        "command": f"python benchmarks/cpu_matmul_chain.py --repeats {args.repeats}",
        "model": engine.model_name,
        "matrices": len(matrices),
        "amx": amx_obstacle() or "available",
        "int8": int8_obstacle() or "available",
        "figures": figures,
    }
    write_result(result, args.out)


if __name__ == "__main__":
    main()
