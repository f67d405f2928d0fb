"""A model's quantized matrix chain (every matrix of one forward, LM head included) on each CPU products kernel
(float32, AMX where the CPU has it, int8 and int8x2 where they build; the kernels that read every matrix of the
model), at 1, 5 and 16 input rows by default: what a plain step, a DDTree verification of 4 nodes and one of 15
nodes cost in the products alone. The chains take turns (every model and kernel once per repeat, interleaved), so a
change in the machine's load moves every figure alike; each figure is the min and the median over the repeats.

`--model` takes GGUF files (repeat it to compare files of the same shape in different formats, e.g. from
`dflash bench make-gguf --quant q4_k_m` and `--quant q4_1`); the default is the default model.

    python benchmarks/cpu_matmul_chain.py --out results/cpu_matmul_chain.json
    python benchmarks/cpu_matmul_chain.py --model a-q4_k_m.gguf --model a-q4_1.gguf --rows 1,9 --kinds int8x2
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from gguf import GGMLQuantizationType

from dflash.bench.provenance import provenance, write_result
from dflash.engine.loading import LoadOptions, load_engine
from dflash.models.cpu_matmul import amx_obstacle, int8_obstacle, int8_only_formats
from dflash.models.quantized_layers import QuantizedLinear


def chain_seconds(matrices: list[QuantizedLinear], inputs: list[torch.Tensor], kind: str) -> float:
    for matrix in matrices:
        matrix.use_products(kind)
    started = time.perf_counter()
    for matrix, x in zip(matrices, inputs, strict=True):
        matrix(x)
    return time.perf_counter() - started


def chains_ms(
    chains: dict[str, list[QuantizedLinear]], kinds: dict[str, list[str]], rows: int, repeats: int
) -> dict[str, dict[str, tuple[float, float]]]:
    """model -> kind -> (min, median) chain in ms over `repeats`, every (model, kind) once per repeat in turn (after
    3 warm-up chains each)."""
    inputs = {model: [torch.randn(rows, m.in_features) for m in matrices] for model, matrices in chains.items()}
    seconds: dict[tuple[str, str], list[float]] = {(model, kind): [] for model in chains for kind in kinds[model]}
    for repeat in range(repeats + 3):
        for model, kind in seconds:
            took = chain_seconds(chains[model], inputs[model], kind)
            if repeat >= 3:
                seconds[model, kind].append(took)
    figures: dict[str, dict[str, tuple[float, float]]] = {model: {} for model in chains}
    for (model, kind), times in seconds.items():
        figures[model][kind] = (round(min(times) * 1000, 2), round(statistics.median(times) * 1000, 2))
    return figures


def readable_kinds(matrices: list[QuantizedLinear]) -> list[str]:
    """The kernels that read every matrix and run here."""
    formats = {GGMLQuantizationType(m.qtype) for m in matrices}
    kinds = [] if int8_only_formats(formats) else ["float32"] + ([] if amx_obstacle() else ["amx"])
    return kinds + ([] if int8_obstacle() else ["int8", "int8x2"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", action="append", default=None, help="a GGUF file (repeatable; default: the default model)")
    parser.add_argument("--rows", default="1,5,16", help="input rows per product, comma-separated")
    parser.add_argument("--kinds", default=None, help="kernels, comma-separated (default: every one that reads the model)")
    parser.add_argument("--repeats", type=int, default=20, help="chains per figure (min and median kept)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    rows_list = [int(r) for r in args.rows.split(",")]
    chains: dict[str, list[QuantizedLinear]] = {}
    kinds: dict[str, list[str]] = {}
    formats: dict[str, dict[str, int]] = {}
    device = None
    for model in args.model or ["default"]:
        engine = load_engine(model, "none", loading=LoadOptions(device="cpu", weights="quantized"))
        device = engine.device
        name = engine.model_name
        chains[name] = [m for m in engine.target.modules() if isinstance(m, QuantizedLinear)]
        readable = readable_kinds(chains[name])
        kinds[name] = [k for k in args.kinds.split(",") if k in readable] if args.kinds else readable
        formats[name] = {}
        for m in chains[name]:
            qtype = GGMLQuantizationType(m.qtype).name
            formats[name][qtype] = formats[name].get(qtype, 0) + 1
    figures: dict[str, Any] = {model: {kind: {} for kind in kinds[model]} for model in chains}
    with torch.inference_mode():
        for rows in rows_list:
            for model, per_kind in chains_ms(chains, kinds, rows, args.repeats).items():
                for kind, (best, median) in per_kind.items():
                    figures[model][kind][f"{rows}_rows_ms"] = {"min": best, "median": median}
    for model, per_kind in figures.items():
        for kind, per_rows in per_kind.items():
            print(model, kind, per_rows)
    assert device is not None
    result: dict[str, Any] = {
        **provenance(device),
        "command": "python benchmarks/cpu_matmul_chain.py " + " ".join(
            [f"--model {m}" for m in args.model or []] + [f"--rows {args.rows}", f"--repeats {args.repeats}"]
            + ([f"--kinds {args.kinds}"] if args.kinds else [])
        ),
        "matrices": {model: len(matrices) for model, matrices in chains.items()},
        "formats": formats,
        "amx": amx_obstacle() or "available",
        "int8": int8_obstacle() or "available",
        "figures": figures,
    }
    write_result(result, args.out)


if __name__ == "__main__":
    main()
