"""One-row attention: SDPA against the split-key program under different grid constants of the program
(`TARGET_PROGRAMS`, `MIN_SLICE`, `BLOCK_N` of `dflash.kernels.triton_attention`), both model shapes, 512-16K keys.

Usage: cd benchmarks && PYTHONPATH=../src python gpu_attention_grid_scan.py
"""

from __future__ import annotations

import itertools

from gpu_attention_rows import SHAPES, time_shape  # benchmarks/ is the script's folder

import dflash.kernels.triton_attention as program


def main() -> None:
    for name, (heads, kv_heads, head_dim) in SHAPES.items():
        for context in (512, 2048, 8192, 16384):
            for programs, min_slice, block_n in itertools.product((132, 264, 528, 1056), (64, 256), (32, 64)):
                program.TARGET_PROGRAMS, program.MIN_SLICE, program.BLOCK_N = programs, min_slice, block_n
                print(name, context, programs, min_slice, block_n, time_shape(heads, kv_heads, head_dim, 1, context),
                      flush=True)


if __name__ == "__main__":
    main()
