"""4-bit GGUF products through integer dot products (`dflash.kernels.triton_gguf_int8`) against the block programs
(`triton_gguf_matmul`) and dense bf16 cuBLAS, on a model's weight shapes.

For each shape, 4-bit format and row count: the time per matrix of `nibble_matmul` (inputs rounded once per call,
outside the timed chain, as a layer shares one rounding between its products; that rounding timed apart), of the
block program's configuration in use, and of `F.linear` in bf16; the bandwidth each implies (the word layout's
bytes, the file's bytes, bf16 bytes), beside a device copy's. Chains over distinct copies stay out of L2, replayed
as CUDA graphs (`gpu_gguf_matmul.py`'s harness). `--grid` times the configurations in GRID for each row count.

Usage: python benchmarks/gpu_gguf_int8.py --out FILE [--shapes qwen3-8b] [--formats Q4_K,Q4_0] [--rows 1,2,4,8] [--grid]
       TRITON_INTERPRET=1 python benchmarks/gpu_gguf_int8.py --dry-run  (CPU, tiny shapes)
"""

from __future__ import annotations

import argparse
from dataclasses import asdict

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gpu_gguf_matmul import (
    CHAIN_BYTES,
    MAX_COPIES,
    random_blocks,
    run_shapes,
    shape_arguments,
    timed_ms,
    write_report,
)

from dflash.kernels.gguf_nibbles import nibble_matrix
from dflash.kernels.triton_gguf_int8 import (
    MAX_ROWS,
    NibbleConfig,
    nibble_config,
    nibble_dequantize,
    nibble_dot,
    nibble_matmul,
    quantize_input,
)
from dflash.kernels.triton_gguf_matmul import FORMATS, gguf_matmul

DOT_GRID = [(32, 4, 4), (64, 4, 4), (64, 8, 8), (128, 4, 8), (64, 2, 4), (32, 16, 8)]
DEQUANTIZE_GRID = [(16, 8, 4), (32, 4, 4), (64, 4, 8), (8, 16, 4), (32, 8, 8)]
GRID = [NibbleConfig(block_n, step, warps, 2) for block_n in (2, 4, 8) for step in (16, 32) for warps in (4, 8)]


def measure(n: int, k: int, qtype: GGMLQuantizationType, rows_list: list[int], args: argparse.Namespace,
            device: torch.device, dtype: torch.dtype, graphs: bool) -> dict[str, object]:
    file_bytes = n * FORMATS[qtype].row_bytes(k)
    copies = 1 if args.dry_run else max(1, min(MAX_COPIES, -(-CHAIN_BYTES // file_bytes)))
    blocks = [random_blocks(n, k, qtype, device) for _ in range(copies)]
    matrices = [nibble_matrix(b, qtype, k) for b in blocks]
    word_bytes = matrices[0].nbytes
    dense_copies = 1 if args.dry_run else max(1, min(MAX_COPIES, -(-CHAIN_BYTES // (2 * n * k))))
    dense = [torch.randn(n, k, dtype=dtype, device=device) * 0.02 for _ in range(dense_copies)]
    entry: dict[str, object] = {"n": n, "k": k, "file_bytes": file_bytes, "word_bytes": word_bytes, "copies": copies}
    targets = [torch.empty((n, k), dtype=dtype, device=device) for _ in range(min(copies, 2))]
    dequantized: dict[str, object] = {}
    for block_n, step, warps in DEQUANTIZE_GRID if args.grid else DEQUANTIZE_GRID[:1]:
        ms = timed_ms(lambda b=block_n, s=step, w=warps: [nibble_dequantize(m, dtype, targets[i % 2 if len(targets) > 1 else 0], b, s, w)
                                                           for i, m in enumerate(matrices)],
                      args.iters, graphs) / copies
        dequantized[f"block_n={block_n} group_step={step} warps={warps}"] = {
            "ms": round(ms, 5), "GBps_read_plus_written": round((word_bytes + 2 * n * k) / ms / 1e6, 1)}
    entry["dequantize"] = dequantized
    for rows in rows_list:
        x = torch.randn(rows, k, dtype=dtype, device=device)
        parts = quantize_input(x)
        reference = F.linear(x.float(), matrices[0].dequantized())
        got = nibble_matmul(parts, matrices[0], dtype=torch.float32) if rows <= MAX_ROWS else nibble_dot(x, matrices[0])
        error = float((got.float() - reference).abs().max() / reference.abs().max().clamp_min(1e-6))
        chosen = nibble_config(n, k)
        configs = [chosen] + ([c for c in GRID if c != chosen] if args.grid else [])
        if rows > MAX_ROWS:
            configs = []
        tried: dict[str, object] = {}
        for config in configs:
            try:
                ms = timed_ms(lambda config=config, parts=parts: [nibble_matmul(parts, m, config, dtype=dtype) for m in matrices],
                              args.iters, graphs) / copies
            except Exception as exc:  # registers or shared memory the device cannot give
                tried[str(asdict(config))] = f"not run: {type(exc).__name__}: {str(exc)[:160]}"
                continue
            tried[str(asdict(config))] = {"ms": round(ms, 5), "word_GBps": round(word_bytes / ms / 1e6, 1)}
        rounding_ms = timed_ms(lambda x=x: quantize_input(x), args.iters, graphs)
        block_ms = timed_ms(lambda x=x: [gguf_matmul(x, b, qtype) for b in blocks], args.iters, graphs) / copies
        dense_ms = timed_ms(lambda x=x: [F.linear(x, w) for w in dense], args.iters, graphs) / dense_copies
        dot_ms = timed_ms(lambda x=x: [nibble_dot(x, m) for m in matrices], args.iters, graphs) / copies
        if args.grid and rows > MAX_ROWS:
            for block_n, step, warps in DOT_GRID:
                try:
                    ms = timed_ms(lambda x=x, b=block_n, s=step, w=warps: [nibble_dot(x, m, None, b, s, w) for m in matrices],
                                  args.iters, graphs) / copies
                    tried[f"dot block_n={block_n} group_step={step} warps={warps}"] = {"ms": round(ms, 5)}
                except Exception as exc:
                    tried[f"dot block_n={block_n} group_step={step} warps={warps}"] = f"not run: {str(exc)[:100]}"
        tried["tensor cores (nibble_dot)"] = {"ms": round(dot_ms, 5), "word_GBps": round(word_bytes / dot_ms / 1e6, 1)}
        best = min((v["ms"], key) for key, v in tried.items() if isinstance(v, dict))
        result = {
            "relative_error": float(f"{error:.3g}"), "chosen": tried.get(str(asdict(chosen))),
            "dot_ms": round(dot_ms, 5),
            "best": {"config": best[1], "ms": best[0]}, "input_rounding_ms": round(rounding_ms, 5),
            "block_program_ms": round(block_ms, 5), "dense_bf16_ms": round(dense_ms, 5),
            "dense_GBps": round(2 * n * k / dense_ms / 1e6, 1),
            "best_over_block_program": round(best[0] / block_ms, 3), "best_over_dense": round(best[0] / dense_ms, 3),
        }
        if args.grid:
            result["grid"] = tried
        entry[f"rows{rows}"] = result
        print(f"{qtype.name:5s} {n:6d}x{k:<6d} rows {rows}: best {best[0] * 1e3:7.1f} us dot {dot_ms * 1e3:7.1f} "
              f"({word_bytes / best[0] / 1e6:6.0f} GB/s)  blocks {block_ms * 1e3:7.1f}  bf16 {dense_ms * 1e3:7.1f}  "
              f"rounding {rounding_ms * 1e3:5.1f}  err {error:.2g}", flush=True)
    return entry


def main(argv: list[str] | None = None) -> None:
    parser = shape_arguments(__doc__.splitlines()[0], shapes="qwen3-8b", formats="Q4_K,Q4_0", rows="1,2,4,8",
                             iters=30)
    args = parser.parse_args(argv)
    report = run_shapes(args, measure, "benchmarks/gpu_gguf_int8.py", argv)
    report["notes"] = ("ms per matrix (a chain over `copies` distinct random matrices, CUDA graph, median of --iters "
                       "replays); word_GBps = the word layout's bytes / time; inputs rounded outside the chain "
                       "(input_rounding_ms: that rounding for one call); block_program: gguf_matmul's configuration "
                       "in use; dense: F.linear on a bf16 matrix of the same shape")
    write_report(report, args.out)

if __name__ == "__main__":
    main()
