"""The CUDA program for 1-8 rows with GGUF words (`kernels/cuda_nibble_rows.cu`) against the Triton program
(`DFLASH_GGUF_ROWS=triton`) on Qwen3-8B's matrices (random Q4_K / Q6_K words): kernel time per product, 20 copies of
the product captured in one CUDA graph per replay (no launch cost), the median of the replays, and the word bytes
streamed per second; 1, 4 and 8 input rows, one and two input parts; the two programs take turns. `--variants
2x4,4x4,...` compares builds of the CUDA program with other tilings instead (weight rows per warp x groups per lane
per step).

Usage: python benchmarks/gpu_nibble_rows.py --out FILE [--variants 2x4,4x4 --rows 1]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gpu_scale_study import as_graph, median_ms  # benchmarks/ is on the path

from dflash.bench.gguf_shapes import SHAPES, Shape
from dflash.bench.provenance import provenance
from dflash.bench.random_gguf import random_blocks
from dflash.kernels.gguf_nibbles import nibble_matrix
from dflash.kernels.triton_gguf_int8 import FORMAT_CODES, nibble_matmul, quantize_input

Q4_K, Q6_K = GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K


def decoder_matrices(shape: Shape) -> list[tuple[str, int, int, GGMLQuantizationType]]:
    """A decoder's matrices as (name, rows n, columns k, format): Q4_K_M keeps most in Q4_K, some down projections
    and the head in Q6_K."""
    attention = shape.heads * shape.head_dim
    return [
        ("qkv", attention + 2 * shape.kv_heads * shape.head_dim, shape.hidden, Q4_K),
        ("o", shape.hidden, attention, Q4_K),
        ("gate_up", 2 * shape.intermediate, shape.hidden, Q4_K),
        ("down", shape.hidden, shape.intermediate, Q4_K),
        ("down_q6", shape.hidden, shape.intermediate, Q6_K),
        ("lm_head_q6", shape.vocab, shape.hidden, Q6_K),
    ]


MATRICES = decoder_matrices(SHAPES["qwen3-8b"])
COPIES = 20


def graphed_us(product: Callable[[], object]) -> float:
    def copies() -> None:
        for _ in range(COPIES):
            product()

    return median_ms(as_graph(copies), iters=15) * 1e3 / COPIES


def variant_kernels(variants: str) -> dict[str, Any]:
    """Builds of the CUDA program with other tilings, "ROWSxUNROLL[xBLOCKS][@SOURCE]": weight rows per warp x groups
    per lane per step [x blocks an SM must hold, which caps the registers] [from another source file, e.g. an
    earlier revision of the program], each in its own folder, built in parallel threads."""
    import hashlib
    from concurrent.futures import ThreadPoolExecutor

    from torch.utils.cpp_extension import load

    checkout_source = Path(__file__).resolve().parents[1] / "src" / "dflash" / "kernels" / "cuda_nibble_rows.cu"

    def build(variant: str) -> Any:
        tiling, _, other = variant.partition("@")
        source = Path(other) if other else checkout_source
        rows, unroll, *blocks = tiling.split("x")
        flags = ["-O3", f"-DDFLASH_ROWS_PER_WARP={rows}", f"-DDFLASH_UNROLL={unroll}"]
        flags += [f"-DDFLASH_MIN_BLOCKS={blocks[0]}"] if blocks else []
        key = hashlib.sha256(f"{variant}:{source.read_text()}".encode()).hexdigest()[:12]
        folder = Path(tempfile.gettempdir()) / f"nibble_rows_{key}"
        folder.mkdir(exist_ok=True)
        return load(name=f"nibble_rows_{key}", sources=[str(source)], build_directory=str(folder),
                    extra_cuda_cflags=flags)

    names = variants.split(",")
    with ThreadPoolExecutor(len(names)) as pool:
        return dict(zip(names, pool.map(build, names), strict=True))


def variant_run(kernel: Any, quantized: Any, matrix: Any, out: torch.Tensor) -> None:
    sub = matrix.sub_scales if matrix.sub_scales is not None else matrix.pairs
    tops = matrix.high_bits if matrix.high_bits is not None else matrix.words
    kernel.nibble_rows(quantized.high, quantized.low, quantized.scale, quantized.total, quantized.half_total,
                       matrix.words, tops, matrix.pairs, sub, out, FORMAT_CODES[matrix.qtype], quantized.parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,4,8")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--variants", default="", help="builds to compare instead, e.g. 2x4,4x4,2x4x5,2x4@old.cu")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    device = torch.device("cuda")
    variants = variant_kernels(args.variants) if args.variants else {}
    rng = np.random.default_rng(0)
    result: dict[str, Any] = {**provenance(device), "copies_per_replay": COPIES, "variants": args.variants,
                              "matrices": {}}
    for name, n, k, qtype in MATRICES:
        matrix = nibble_matrix(torch.from_numpy(random_blocks(n, k, qtype, rng)).to(device), qtype, k)
        entry: dict[str, Any] = {"n": n, "k": k, "format": qtype.name, "mb": round(matrix.nbytes / 1e6, 1)}
        for rows in (int(r) for r in args.rows.split(",")):
            for parts in (1, 2):
                x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
                quantized = quantize_input(x, parts=parts)
                out = torch.empty(rows, n, device=device, dtype=torch.bfloat16)
                if variants:
                    times: dict[str, list[float]] = {variant: [] for variant in variants}
                    for _ in range(args.repeats):
                        for variant, kernel in variants.items():
                            times[variant].append(graphed_us(partial(variant_run, kernel, quantized, matrix, out)))
                else:
                    times = {"cuda": [], "triton": []}
                    for _ in range(args.repeats):
                        for program in times:
                            os.environ["DFLASH_GGUF_ROWS"] = program
                            times[program].append(graphed_us(partial(nibble_matmul, quantized, matrix, out=out)))
                    os.environ.pop("DFLASH_GGUF_ROWS", None)
                us = {program: min(values) for program, values in times.items()}
                entry[f"rows_{rows}_parts_{parts}"] = {
                    "us": {p: round(v, 2) for p, v in us.items()},
                    "gb_s": {p: round(matrix.nbytes / v / 1e3, 1) for p, v in us.items()},
                }
                if not variants:
                    entry[f"rows_{rows}_parts_{parts}"]["cuda_speedup"] = round(us["triton"] / us["cuda"], 3)
                print(name, rows, parts, json.dumps(entry[f"rows_{rows}_parts_{parts}"]), flush=True)
        result["matrices"][name] = entry
        del matrix
        torch.cuda.empty_cache()
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
