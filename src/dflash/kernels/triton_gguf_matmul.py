"""Products with GGUF-quantized weights on the GPU: y = x @ dequant(W)^T, W read as its file's blocks.

W is the `QuantizedMatrix` layout moved to the device unchanged: uint8 [n, row_bytes], each row k / block_values
blocks of Q4_0, Q4_1, Q8_0 (32 values) or Q4_K, Q5_K, Q6_K (256-value super-blocks), no re-layout at load time.

* `gguf_matmul`, for 1 to `MAX_ROWS` rows of x (decode steps, verifications): each program owns `block_n` rows of W,
  walks them in steps of `blocks_per_step` blocks, dequantises a step's tile in registers (float32) and multiplies
  it by every row of x at once (tensor cores through `tl.dot`, x padded to 16+ rows, the tile rounded to x's dtype;
  one row: multiply-and-sum in float32 on the CUDA cores), so W is read once whatever the number of rows.
  Sums are float32, rounded once to x's dtype. The programs are in `triton_gguf_programs.py`.
* `gguf_dequantize`: blocks -> a dense [n, k] matrix in any float dtype (prefill products, embedding rows).
* `dflash.kernels.gpu_quantized_products.quantized_linear` puts them together with the 4-bit word programs
  (`triton_gguf_int8`): up to `MAX_ROWS` rows per part, else W dequantised into a temporary for cuBLAS (one matrix
  of bf16 at a time, which PyTorch's caching allocator reuses between calls: its peak is the largest matrix, the
  LM head), meant for prefill chunks, whose products are many rows.

Configurations are fixed by shape (no autotuning), `gguf_matmul_config`; `benchmarks/gpu_gguf_matmul.py` times them
against bf16 cuBLAS.

Speed, measured on one H200 (that benchmark, Qwen3-8B and Qwen3-32B shapes, Triton 3.6, 2026-11-26;
results/gpu_gguf_matmul_h200.json): the programs
are instruction-bound, not memory-bound. One row reads 0.56 to 1.17 TB/s of blocks for the 4-bit formats and Q6_K,
1.0 to 1.7 TB/s for Q8_0 (a device copy moved 2.7 TB/s read plus written), so a product takes 1.0 to 2.6 times as
long as cuBLAS on the same matrix in bf16 (1.0-1.4 for Q4_K and Q4_0, 1.4-2.6 for Q6_K); 4 to 64 rows take 1.2 to
5.2 times as long. The Q4_0, Q4_1, Q4_K and Q6_K matrices now go through the word programs instead
(`triton_gguf_int8`: 1.4-1.9x faster than these at one row); these serve Q8_0 and Q5_K.
A layout that loads 16/32-bit words and widens nibbles by OR-ing them into the float 2^23 was tried on the same
machine: slower for Q4_K at one row (0.7x on an 8B model's LM head) and for every format through tensor cores (each
step's nibble tiles had to be joined for `tl.dot`), faster only for Q6_K and Q8_0 at one row on the LM head
(1.2-1.4x); not kept.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from types import ModuleType

import torch
from gguf import GGMLQuantizationType

from dflash.kernels.triton_decode import interpreting, next_power_of_two

__all__ = [
    "FORMATS",
    "MAX_ROWS",
    "GGUFFormat",
    "GGUFMatmulConfig",
    "gguf_dequantize",
    "gguf_matmul",
    "gguf_matmul_config",
    "gguf_programs_usable",
]

MAX_ROWS = 64
T = GGMLQuantizationType


@dataclass(frozen=True)
class GGUFFormat:
    """How the programs read one GGML type: `code` is their FORMAT; a group is the run of values sharing one scale."""

    code: int
    block_values: int
    block_bytes: int
    group: int
    groups_per_block: int

    def row_bytes(self, k: int) -> int:
        return k // self.block_values * self.block_bytes


FORMATS: dict[GGMLQuantizationType, GGUFFormat] = {
    T.Q4_0: GGUFFormat(0, 32, 18, 32, 1),
    T.Q4_1: GGUFFormat(1, 32, 20, 32, 1),
    T.Q8_0: GGUFFormat(2, 32, 34, 32, 1),
    T.Q4_K: GGUFFormat(3, 256, 144, 32, 8),
    T.Q5_K: GGUFFormat(4, 256, 176, 32, 8),
    T.Q6_K: GGUFFormat(5, 256, 210, 16, 16),
}
FOUR_BIT = (T.Q4_0, T.Q4_1, T.Q4_K, T.Q5_K)  # their wide matrices want wider tiles past 16 rows


@dataclass(frozen=True)
class GGUFMatmulConfig:
    block_n: int = 16
    values_per_step: int = 256  # a multiple of the format's block (whole blocks per step), a power of two
    warps: int = 4
    stages: int = 2
    use_dot: bool = True  # False: multiply-and-sum, one row only


def gguf_matmul_config(rows: int, qtype: GGMLQuantizationType, n: int = 0) -> GGUFMatmulConfig:
    """Chosen from `benchmarks/gpu_gguf_matmul.py --grid` on an H200 over Qwen3-8B shapes (each the best or within
    about 10% of it there): one row in 8-output tiles of 512-value steps; more rows through tensor cores, in 16-output
    tiles, 32 for wide matrices (n >= 16384: gate/up, LM head), Q8_0 up to 16 rows in 512-value steps, and the 4-bit
    formats past 16 rows of a wide matrix in 64-output tiles of 8 warps (1.04-1.1x faster than 32 for Q4_K,
    about 1.3-1.5x for Q4_0)."""
    wide = n >= 16384
    if rows == 1:
        return GGUFMatmulConfig(block_n=8, values_per_step=512, warps=4, stages=2, use_dot=False)
    if qtype == T.Q8_0 and rows <= 16:
        return GGUFMatmulConfig(block_n=32, values_per_step=512, warps=4, stages=3, use_dot=True)
    if rows > 16 and wide and qtype in FOUR_BIT:
        return GGUFMatmulConfig(block_n=64, values_per_step=256, warps=8, stages=2, use_dot=True)
    return GGUFMatmulConfig(block_n=32 if wide else 16, values_per_step=256, warps=4, stages=2, use_dot=True)


def gguf_programs_usable(device: torch.device) -> bool:
    """Triton is installed and the tensors are on a CUDA device (or Triton's interpreter runs them on the CPU)."""
    from dflash.kernels.triton_decode import triton_available

    return triton_available() and (device.type == "cuda" or interpreting())


@cache
def _programs() -> ModuleType:
    from dflash.kernels import triton_gguf_programs

    return triton_gguf_programs


def _format(qtype: GGMLQuantizationType, blocks: torch.Tensor, k: int) -> GGUFFormat:
    if qtype not in FORMATS:
        raise ValueError(f"the GPU programs do not read {qtype.name} blocks")
    layout = FORMATS[qtype]
    if k % layout.block_values:
        raise ValueError(f"rows of {k} values are not whole {qtype.name} blocks of {layout.block_values}")
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] != layout.row_bytes(k):
        raise ValueError(
            f"{qtype.name} blocks for rows of {k} values must be uint8 [n, {layout.row_bytes(k)}], "
            f"got {blocks.dtype} {list(blocks.shape)}"
        )
    if not blocks.is_contiguous():
        raise ValueError("the blocks must be contiguous")
    return layout


def _blocks_per_step(layout: GGUFFormat, values_per_step: int) -> int:
    return max(1, values_per_step // layout.block_values)


def gguf_matmul(
    x: torch.Tensor,
    blocks: torch.Tensor,
    qtype: GGMLQuantizationType,
    config: GGUFMatmulConfig | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x: [rows, k] contiguous (bfloat16, float16; float32 for tests), 1 <= rows <= `MAX_ROWS`; blocks: uint8
    [n, row bytes] of `qtype` on x's device -> x @ dequant(W)^T [rows, n] in x's dtype (float32 sums), written
    into `out` when given (x's dtype, [rows, n], columns contiguous: e.g. a slice of a wider output's columns)."""
    rows, k = x.shape
    layout = _format(qtype, blocks, k)
    config = config or gguf_matmul_config(rows, qtype, blocks.shape[0])
    if not 1 <= rows <= (MAX_ROWS if config.use_dot else 1):
        raise ValueError(f"gguf_matmul does not serve {rows} rows with {config}")
    if not x.is_contiguous():
        raise ValueError("x must be contiguous")
    n = blocks.shape[0]
    if out is None:
        out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    elif out.shape != (rows, n) or out.dtype != x.dtype or out.stride(1) != 1:
        raise ValueError(f"out must be {x.dtype} [{rows}, {n}] with contiguous columns")
    blocks_per_step = _blocks_per_step(layout, config.values_per_step)
    _programs().gguf_matmul_kernel[(-(-n // config.block_n),)](
        x, blocks, out, rows, n, k, layout.row_bytes(k), k // layout.block_values, out.stride(0),
        FORMAT=layout.code, BLOCK_BYTES=layout.block_bytes, BLOCK_VALUES=layout.block_values, GROUP=layout.group,
        GROUPS_PER_BLOCK=layout.groups_per_block, GROUPS=blocks_per_step * layout.groups_per_block,
        BLOCKS_PER_STEP=blocks_per_step, BLOCK_M=max(16, next_power_of_two(rows)), BLOCK_N=config.block_n,
        USE_DOT=config.use_dot, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=config.warps, num_stages=config.stages,
    )
    return out


def gguf_dequantize(
    blocks: torch.Tensor,
    qtype: GGMLQuantizationType,
    k: int,
    dtype: torch.dtype = torch.bfloat16,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """blocks: uint8 [n, row bytes] of `qtype` -> the weights [n, k] in `dtype` (computed in float32, rounded once),
    written into `out` when given (contiguous [n, k], e.g. a block of rows of a wider matrix)."""
    layout = _format(qtype, blocks, k)
    n = blocks.shape[0]
    if out is None:
        out = torch.empty((n, k), dtype=dtype, device=blocks.device)
    elif out.shape != (n, k) or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous [{n}, {k}] matrix")
    if n == 0:
        return out
    blocks_per_step = _blocks_per_step(layout, 256)
    block_n = 16
    grid = (-(-n // block_n), -(-(k // layout.block_values) // blocks_per_step))
    _programs().gguf_dequantize_kernel[grid](
        blocks, out, n, k, layout.row_bytes(k), k // layout.block_values,
        FORMAT=layout.code, BLOCK_BYTES=layout.block_bytes, BLOCK_VALUES=layout.block_values, GROUP=layout.group,
        GROUPS_PER_BLOCK=layout.groups_per_block, GROUPS=blocks_per_step * layout.groups_per_block,
        BLOCKS_PER_STEP=blocks_per_step, BLOCK_N=block_n, num_warps=4,
    )
    return out
