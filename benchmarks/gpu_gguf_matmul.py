"""GGUF block products (`dflash.kernels.triton_gguf_matmul`) against dense bf16 cuBLAS on a model's weight shapes.

For each model shape, block format and row count: the time of `gguf_matmul` per matrix of each kind (fused q/k/v,
attention output, fused gate/up, down, LM head), and of `F.linear` on the same shape in bf16; the quantized bytes
read per matrix and the bandwidth they imply, beside a device-to-device copy's measured bandwidth (bytes read plus
written). Each kind is a chain over enough distinct copies of random blocks to stay out of L2, replayed as a CUDA
graph (launches cost more than the small products), the median of `--iters` replays. Every chain is checked first:
the program against cuBLAS on the dequantised matrix. `--grid` also times a few other configurations per row count.

Usage: python benchmarks/gpu_gguf_matmul.py --out results/gpu_gguf_matmul_h100.json
       [--shapes qwen3-8b,qwen3-32b] [--formats Q4_K,Q6_K,Q8_0,Q4_0] [--rows 1,4,16,64] [--grid]
       TRITON_INTERPRET=1 python benchmarks/gpu_gguf_matmul.py --dry-run --out /tmp/dry.json  (CPU, tiny shapes)
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gpu_skinny_gemm import graph_ms  # benchmarks/ is the script's folder

from dflash.kernels.triton_gguf_matmul import (
    FORMATS,
    GGUFMatmulConfig,
    gguf_dequantize,
    gguf_matmul,
    gguf_matmul_config,
)

SHAPES = {  # model -> matrix kind -> (N, K)
    "qwen3-8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288),
                 "head": (151936, 4096)},
    "qwen3-32b": {"qkv": (10240, 5120), "o": (5120, 8192), "gate_up": (51200, 5120), "down": (5120, 25600),
                  "head": (151936, 5120)},
    "tiny": {"qkv": (96, 512), "down": (64, 768)},  # --dry-run
}
CHAIN_BYTES = 512 * 2**20  # copies of a kind until the chain reads this much (L2 is 50-60 MB)
MAX_COPIES = 36
GRID = [  # --grid: (block_n, values_per_step, warps, stages, use_dot)
    GGUFMatmulConfig(4, 256, 4, 2, False), GGUFMatmulConfig(8, 256, 4, 2, False), GGUFMatmulConfig(8, 512, 4, 2, False),
    GGUFMatmulConfig(16, 512, 4, 2, False), GGUFMatmulConfig(8, 1024, 8, 2, False), GGUFMatmulConfig(16, 256, 4, 2, True),
    GGUFMatmulConfig(32, 256, 4, 2, True), GGUFMatmulConfig(32, 512, 4, 3, True), GGUFMatmulConfig(64, 256, 8, 2, True),
    GGUFMatmulConfig(32, 256, 8, 3, True),
]


def random_blocks(n: int, k: int, qtype: GGMLQuantizationType, device: torch.device) -> torch.Tensor:
    """uint8 [n, row bytes]: random bytes with every fp16 scale field set to a small finite value (speed does not
    depend on the values; random scale bytes could be inf or NaN)."""
    layout = FORMATS[qtype]
    blocks = torch.randint(0, 256, (n, k // layout.block_values, layout.block_bytes), dtype=torch.uint8, device=device)
    halves = {"Q4_0": [0], "Q4_1": [0, 2], "Q8_0": [0], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}[qtype.name]
    scale = torch.tensor([1.0e-3], dtype=torch.float16).view(torch.uint8).to(device)  # [2]
    for offset in halves:
        blocks[:, :, offset : offset + 2] = scale
    return blocks.reshape(n, -1)


def timed_ms(fn: Callable[[], object], iters: int, graphs: bool) -> float:
    """Median milliseconds of `fn`: CUDA-graph replays timed with events, or (CPU, --dry-run) wall-clock calls."""
    if not graphs:
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)
    return graph_ms(fn, iters)  # compiled and warmed up outside the capture


def copy_bandwidth(device: torch.device, iters: int, graphs: bool) -> float:
    """GB/s of a device-to-device copy of 1 GiB (256 KiB on the CPU), bytes read plus written."""
    size = 2**30 if graphs else 2**18
    source = torch.empty(size, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    ms = timed_ms(lambda: target.copy_(source), iters, graphs)
    return 2 * size / ms / 1e6


def check(x: torch.Tensor, blocks: torch.Tensor, qtype: GGMLQuantizationType, config: GGUFMatmulConfig) -> float:
    """Relative error of the program against cuBLAS on the dequantised matrix (both in x's dtype)."""
    expected = F.linear(x, gguf_dequantize(blocks, qtype, x.shape[1], x.dtype)).float()
    got = gguf_matmul(x, blocks, qtype, config).float()
    return ((got - expected).abs().max() / expected.abs().max().clamp_min(1e-6)).item()


def measure_kind(
    n: int, k: int, qtype: GGMLQuantizationType, rows_list: list[int], args: argparse.Namespace, device: torch.device,
    dtype: torch.dtype, graphs: bool,
) -> dict[str, object]:
    layout = FORMATS[qtype]
    matrix_bytes = n * layout.row_bytes(k)
    copies = 1 if args.dry_run else max(1, min(MAX_COPIES, -(-CHAIN_BYTES // matrix_bytes)))
    chain = [random_blocks(n, k, qtype, device) for _ in range(copies)]
    dense_copies = 1 if args.dry_run else max(1, min(MAX_COPIES, -(-CHAIN_BYTES // (2 * n * k))))
    dense = [torch.randn(n, k, dtype=dtype, device=device) * 0.02 for _ in range(dense_copies)]
    entry: dict[str, object] = {"n": n, "k": k, "quantized_bytes": matrix_bytes, "dense_bytes": 2 * n * k,
                                "copies": copies, "dense_copies": dense_copies}
    for rows in rows_list:
        x = torch.randn(rows, k, dtype=dtype, device=device)
        chosen = gguf_matmul_config(rows, qtype, n)
        configs = [chosen] + ([c for c in GRID if c != chosen and (c.use_dot or rows == 1)] if args.grid else [])
        tried: dict[str, object] = {}
        for config in configs:
            try:
                error = check(x, chain[0], qtype, config)
            except Exception as exc:  # a configuration the device cannot run (shared memory, registers)
                tried[str(config)] = f"not run: {type(exc).__name__}: {str(exc)[:200]}"
                continue
            if error > 2e-2:
                tried[str(config)] = f"wrong (relative error {error:.3g})"
                continue
            ms = timed_ms(lambda x=x, config=config: [gguf_matmul(x, b, qtype, config) for b in chain], args.iters, graphs)
            tried[str(config)] = {"ms": round(ms / copies, 5), "GBps": round(matrix_bytes * copies / ms / 1e6, 1),
                                  "relative_error": float(f"{error:.3g}")}
        dense_ms = timed_ms(lambda x=x: [F.linear(x, w) for w in dense], args.iters, graphs) / dense_copies
        result: dict[str, object] = {
            "dense_bf16_ms": round(dense_ms, 5), "dense_GBps": round(2 * n * k / dense_ms / 1e6, 1),
            "config": asdict(chosen), "chosen": tried.get(str(chosen)),
        }
        if args.grid:
            result["grid"] = tried
        chosen_run = tried.get(str(chosen))
        if isinstance(chosen_run, dict):
            result["over_dense"] = round(float(chosen_run["ms"]) / dense_ms, 3)
        entry[f"rows{rows}"] = result
        print(f"{qtype.name:5s} {n:6d}x{k:<6d} rows {rows:2d}: quantized {chosen_run}  dense bf16 {dense_ms * 1e3:.1f} us",
              flush=True)
    return entry


Measure = Callable[..., dict[str, object]]


def run_shapes(args: argparse.Namespace, measure: Measure, script: str, argv: list[str] | None) -> dict[str, Any]:
    """`measure(n, k, qtype, rows, args, device, dtype, graphs)` for every (shape, format, kind) asked for -> the
    report: date, device, versions, command, the copy bandwidth and the results by "shape/format/kind"."""
    if args.dry_run:
        args.shapes, args.iters = "tiny", 1
        device, dtype, graphs = torch.device("cpu"), torch.float32, False
    else:
        device, dtype, graphs = torch.device("cuda"), torch.bfloat16, True
    torch.manual_seed(0)
    rows_list = [int(r) for r in args.rows.split(",")]
    copy_gbps = copy_bandwidth(device, args.iters, graphs)
    print(f"device-to-device copy: {copy_gbps:.0f} GB/s (read + written)", flush=True)
    results: dict[str, object] = {}
    for shape in args.shapes.split(","):
        for name in args.formats.split(","):
            qtype = GGMLQuantizationType[name]
            for kind, (n, k) in SHAPES[shape].items():
                if kind in args.kinds.split(","):
                    results[f"{shape}/{name}/{kind}"] = measure(n, k, qtype, rows_list, args, device, dtype, graphs)
                    if graphs:
                        torch.cuda.empty_cache()
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if graphs else "cpu (dry run, Triton interpreter)",
        "versions": {"torch": torch.__version__, "triton": __import__("triton").__version__,
                     "python": platform.python_version()},
        "command": " ".join(["python", script, *(sys.argv[1:] if argv is None else argv)]),
        "copy_GBps_read_plus_written": round(copy_gbps, 1),
        "results": results,
    }


def shape_arguments(description: str, *, shapes: str, formats: str, rows: str, iters: int) -> argparse.ArgumentParser:
    """The options `run_shapes` reads, with the script's defaults."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--shapes", default=shapes)
    parser.add_argument("--kinds", default="qkv,o,gate_up,down,head")
    parser.add_argument("--formats", default=formats)
    parser.add_argument("--rows", default=rows)
    parser.add_argument("--iters", type=int, default=iters)
    parser.add_argument("--grid", action="store_true", help="also time the configurations of the script's grid")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU (with TRITON_INTERPRET=1)")
    parser.add_argument("--out", default="")
    return parser


def write_report(report: dict[str, Any], out: str) -> None:
    if out:
        with open(out, "w") as handle:
            json.dump(report, handle, indent=1)


def main(argv: list[str] | None = None) -> None:
    parser = shape_arguments(__doc__.splitlines()[0], shapes="qwen3-8b,qwen3-32b", formats="Q4_K,Q6_K,Q8_0,Q4_0",
                             rows="1,4,16,64", iters=50)
    args = parser.parse_args(argv)
    report = run_shapes(args, measure_kind, "benchmarks/gpu_gguf_matmul.py", argv)
    report["notes"] = ("ms and GBps per matrix (a chain over `copies` distinct random matrices, CUDA graph, median of "
                       "--iters replays); GBps = quantized bytes / time; dense: F.linear on a bf16 matrix of the same "
                       "shape")
    write_report(report, args.out)


if __name__ == "__main__":
    main()
