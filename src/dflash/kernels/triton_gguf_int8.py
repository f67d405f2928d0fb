"""Few-row products with 4-bit GGUF weights through integer dot products (`dp4a`), on `NibbleMatrix` words.

The block programs of `triton_gguf_matmul` turn every 4-bit value into a float before multiplying: about five
instructions per weight, which leaves them instruction-bound at a fraction of the memory bandwidth. Here, as in
the CPU's `int8_matmul.cpp`, each input row is rounded once per call to 8-bit parts per group of 32 values, and a
weight word (8 values) meets the input in two `dp4a` instructions per part after two masks: under one instruction
per weight. The float side per group: acc += (scale_w dx) isum + min_w sx, with isum the group's exact integer sum.

Inputs: two 8-bit parts per group (x ~ dx (256 q + low), dx = max |x| / 127 / 256, about 15 bits): the rounding
moves a product about as little as bf16 inputs would. Every row's rounding depends on that row only and the integer
sums are exact, so a row's result does not depend on how many rows are multiplied together.

`nibble_matmul(x, matrix)`: x [rows, k] (rows <= `MAX_ROWS`), the matrix a `NibbleMatrix` on x's device ->
[rows, n] in x's dtype. Under Triton's CPU interpreter `dp4a` is computed with shifts (no inline PTX there).
Every extra input row costs its own `dp4a`s, so past a few rows the products go to tensor cores instead:
`nibble_dot` (up to `DOT_ROWS` rows: each step's weights dequantised in registers to x's dtype, as two tiles of
every group's first and second halves against the matching columns of x, so no tile is re-laid). `nibble_product`
chooses: `integer_rows()` rows or fewer by integer dot products, then tensor cores, then (prefill chunks) the matrix
dequantised (`nibble_dequantize`) for cuBLAS.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import cache
from types import ModuleType

import torch
from gguf import GGMLQuantizationType

from dflash import environment
from dflash.kernels.build import CudaRowsKernel, KernelUnavailable, load_cuda_rows_kernel
from dflash.kernels.gguf_nibbles import GROUP, NibbleMatrix
from dflash.kernels.triton_decode import (
    RoundingOutputs,
    add_rms_norm_rounded,
    interpreting,
    next_power_of_two,
    silu_and_mul_rounded,
)

__all__ = [
    "CUDA_INTEGER_ROWS",
    "DOT_ROWS",
    "INTEGER_ROWS",
    "MAX_ROWS",
    "NibbleConfig",
    "QuantizedInput",
    "add_rms_norm_quantized",
    "integer_rows",
    "nibble_config",
    "nibble_dequantize",
    "nibble_dot",
    "nibble_matmul",
    "nibble_product",
    "quantize_input",
    "silu_and_mul_quantized",
]

log = logging.getLogger(__name__)

MAX_ROWS = 8
INTEGER_ROWS = 4  # past 4 rows the tensor-core word program is as fast or faster than the Triton integer one (H100)
CUDA_INTEGER_ROWS = 8  # the CUDA integer program beats it up to 8 rows on every Qwen3-8B matrix (1.05-2.3x, H200:
# results/gpu_nibble_rows_h200.json)
DOT_ROWS = 64
PROGRAMS_PER_SM = 4  # tensor-core products: programs per SM a split reduction aims for
MIN_SPLIT_STEPS = 4  # and the fewest steps of GROUP_STEP groups in one part
ROUNDING_GROUPS = 32  # groups of 32 values per rounding program
WIDE_WORDS = 2**31  # a matrix of this many words or more needs 64-bit offsets in the programs
FORMAT_CODES = {
    GGMLQuantizationType.Q4_0: 0, GGMLQuantizationType.Q4_1: 1, GGMLQuantizationType.Q4_K: 2, GGMLQuantizationType.Q6_K: 3,
}


@dataclass(frozen=True)
class QuantizedInput:
    """x [rows, k] as one or two 8-bit parts per group of 32: high, low int8 [rows, k] (`low` unused with one part);
    scale float32 [rows, k / 32] (dx: x ~ dx (256 high + low), or dx high with one part); total float32
    [rows, k / 32] (dx times the group's sum of 256 high + low, or of high); half_total float32 [rows, k / 16] (the
    same over each 16 values, for Q6_K's scales of 16)."""

    high: torch.Tensor
    low: torch.Tensor
    scale: torch.Tensor
    total: torch.Tensor
    half_total: torch.Tensor
    parts: int = 2


@dataclass(frozen=True)
class NibbleConfig:
    """Measured on an H100 at one row over Qwen3-8B's shapes (`results/gpu_gguf_int8_h100.json`, runs
    `one_row_configuration_sweep` and `input_parts`): 2 outputs a program, 64 groups a step, 2 warps was the best or
    near it on every matrix, 1.1x-1.3x faster than 4 outputs / 32 groups / 4 warps with one input part."""

    block_n: int = 2  # weight rows (outputs) per program
    group_step: int = 64  # groups of 32 values per loop step, per weight row
    warps: int = 2
    stages: int = 2


def nibble_config(n: int, k: int) -> NibbleConfig:
    """The configuration for an [n, k] matrix. Chosen by the matrix alone, never by the number of input rows: the
    float sums' order follows the configuration, so a row's result stays the same in any batch."""
    return NibbleConfig()


@cache
def _programs() -> ModuleType:
    from dflash.kernels import triton_gguf_int8_programs

    return triton_gguf_int8_programs


def input_parts() -> int:
    """8-bit parts per input value (`DFLASH_GGUF_INPUT`): two keep about 15 bits; one is llama.cpp's precision
    (its q8_1 blocks), half the integer products and input reads."""
    return 1 if environment.gguf_input() == "int8" else 2


def quantize_input(
    x: torch.Tensor, groups_per_program: int = ROUNDING_GROUPS, parts: int | None = None
) -> QuantizedInput:
    """x: [rows, k] contiguous, k a multiple of 32 -> its `parts` (1 or 2; default `input_parts()`) 8-bit parts per
    group of 32 (`QuantizedInput`); `groups_per_program` (a power of two): groups each program rounds."""
    rounded = _empty_rounding(x, input_parts() if parts is None else parts)
    rows, k = x.shape
    groups = k // GROUP
    per_program = min(groups_per_program, next_power_of_two(groups))
    _programs().quantize_kernel[(rows, -(-groups // per_program))](
        x.contiguous(), rounded.high, rounded.low, rounded.scale, rounded.total, rounded.half_total, k,
        GROUPS=per_program, PARTS=rounded.parts,
    )
    return rounded


def add_rms_norm_quantized(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, *, adds_one: bool = False,
    parts: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, QuantizedInput]:
    """`triton_decode.add_rms_norm` and `quantize_input` of its normed rows in one program -> (normed, the sum,
    the normed rows' `QuantizedInput`, the same values `quantize_input` would give)."""
    rounded = _empty_rounding(x, input_parts() if parts is None else parts)
    normed, summed = add_rms_norm_rounded(x, residual, weight, eps, _arrays(rounded), rounded.parts, adds_one=adds_one)
    return normed, summed, rounded


def silu_and_mul_quantized(gate_up: torch.Tensor, parts: int | None = None) -> tuple[torch.Tensor, QuantizedInput]:
    """`triton_decode.silu_and_mul` and `quantize_input` of its rows in the same programs."""
    rows, double = gate_up.shape
    rounded = _empty_rounding(gate_up.new_empty((rows, double // 2)), input_parts() if parts is None else parts)
    return silu_and_mul_rounded(gate_up, _arrays(rounded), rounded.parts), rounded


def _empty_rounding(x: torch.Tensor, parts: int) -> QuantizedInput:
    """The arrays of `QuantizedInput` for x [rows, k], to be written."""
    if parts not in (1, 2):
        raise ValueError(f"inputs are rounded to one or two 8-bit parts, not {parts}")
    rows, k = x.shape
    if k % GROUP:
        raise ValueError(f"rows of {k} values are not whole groups of {GROUP}")
    groups = k // GROUP
    high = torch.empty((rows, k), dtype=torch.int8, device=x.device)
    low = torch.empty_like(high) if parts == 2 else high  # one part: never read
    scale = torch.empty((rows, groups), dtype=torch.float32, device=x.device)
    half_total = torch.empty((rows, 2 * groups), dtype=torch.float32, device=x.device)
    return QuantizedInput(high, low, scale, torch.empty_like(scale), half_total, parts)


def _arrays(rounded: QuantizedInput) -> RoundingOutputs:
    return rounded.high, rounded.low, rounded.scale, rounded.total, rounded.half_total


def nibble_matmul(
    x: torch.Tensor | QuantizedInput, matrix: NibbleMatrix, config: NibbleConfig | None = None,
    out: torch.Tensor | None = None, dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """x: [rows, k] (1 <= rows <= `MAX_ROWS`) or its `quantize_input` (to share one rounding between several
    matrices) -> x @ W^T [rows, n] in x's dtype (or `dtype`), written into `out` when given (columns contiguous)."""
    quantized = x if isinstance(x, QuantizedInput) else quantize_input(x)
    rows, k = quantized.high.shape
    if k != matrix.k:
        raise ValueError(f"x has rows of {k} values, the matrix {matrix.k}")
    if not 1 <= rows <= MAX_ROWS:
        raise ValueError(f"nibble_matmul serves 1 to {MAX_ROWS} rows, not {rows}")
    config = config or nibble_config(matrix.n, k)
    out_dtype = dtype or (x.dtype if isinstance(x, torch.Tensor) else torch.float32)
    if out is None:
        out = torch.empty((rows, matrix.n), dtype=out_dtype, device=quantized.high.device)
    elif out.shape != (rows, matrix.n) or out.stride(1) != 1:
        raise ValueError(f"out must be [{rows}, {matrix.n}] with contiguous columns")
    rows_kernel = _cuda_rows(quantized, matrix)
    if rows_kernel is not None:
        sub = matrix.sub_scales if matrix.sub_scales is not None else matrix.pairs
        tops = matrix.high_bits if matrix.high_bits is not None else matrix.words
        rows_kernel.nibble_rows(quantized.high, quantized.low, quantized.scale, quantized.total,
                                quantized.half_total, matrix.words, tops, matrix.pairs, sub, out,
                                FORMAT_CODES[matrix.qtype], quantized.parts)
        return out
    grid = (-(-matrix.n // config.block_n),)
    if matrix.qtype == GGMLQuantizationType.Q6_K:
        _programs().six_bit_matmul_kernel[grid](
            quantized.high.view(torch.int32), quantized.low.view(torch.int32), quantized.scale, quantized.half_total,
            matrix.words, matrix.high_bits, matrix.pairs, matrix.sub_scales, out, rows, matrix.n, k, out.stride(0),
            BLOCK_M=next_power_of_two(rows), BLOCK_N=config.block_n, GROUP_STEP=config.group_step,
            EMULATE=interpreting(), PARTS=quantized.parts, WIDE=matrix.words.numel() >= WIDE_WORDS,
            num_warps=config.warps, num_stages=config.stages,
        )
        return out
    sub = matrix.sub_scales if matrix.sub_scales is not None else matrix.pairs
    _programs().nibble_matmul_kernel[grid](
        quantized.high.view(torch.int32), quantized.low.view(torch.int32), quantized.scale, quantized.total,
        matrix.words, matrix.pairs, sub, out, rows, matrix.n, k, out.stride(0),
        FORMAT=FORMAT_CODES[matrix.qtype], BLOCK_M=next_power_of_two(rows), BLOCK_N=config.block_n, GROUP_STEP=config.group_step,
        EMULATE=interpreting(), PARTS=quantized.parts, WIDE=matrix.words.numel() >= WIDE_WORDS,
        num_warps=config.warps, num_stages=config.stages,
    )
    return out


def integer_rows(device: torch.device) -> int:
    """Rows up to which products take integer dot products rather than tensor cores: `CUDA_INTEGER_ROWS` where the
    CUDA program serves them, else `INTEGER_ROWS`. (A row's result can then differ between 4 and 8 rows only where
    the CUDA program is missing, which no engine mixes.)"""
    if device.type == "cuda" and not interpreting() and environment.gguf_rows() == "cuda" and _cuda_rows_kernel():
        return CUDA_INTEGER_ROWS
    return INTEGER_ROWS


def _cuda_rows(quantized: QuantizedInput, matrix: NibbleMatrix) -> CudaRowsKernel | None:
    """The CUDA program for these operands (`cuda_nibble_rows.cu`: 1-8 rows on a GPU, 16-byte aligned words and
    inputs, 4-byte aligned scale pairs), or None: the Triton program serves them (`DFLASH_GGUF_ROWS=triton`, the
    interpreter, no nvcc)."""
    if not quantized.high.is_cuda or interpreting() or environment.gguf_rows() != "cuda" or quantized.high.shape[0] > MAX_ROWS:
        return None
    if any(t.data_ptr() % 16 for t in (quantized.high, quantized.low, matrix.words)) or matrix.pairs.data_ptr() % 4:
        return None
    return _cuda_rows_kernel()


@cache
def _cuda_rows_kernel() -> CudaRowsKernel | None:
    try:
        return load_cuda_rows_kernel()
    except KernelUnavailable as exc:
        log.warning("the CUDA products of GGUF words are unavailable, the Triton program serves them: %s", exc)
        return None


def nibble_dot(
    x: torch.Tensor, matrix: NibbleMatrix, out: torch.Tensor | None = None, block_n: int = 128,
    group_step: int = 4, warps: int = 4, splits: int | None = None,
) -> torch.Tensor:
    """x: [rows, k] contiguous (16-bit; float32 for tests), rows <= `DOT_ROWS` -> x @ W^T [rows, n] in x's dtype
    on tensor cores (float32 sums), written into `out` when given (columns contiguous).

    A matrix of few output blocks would leave most of the GPU idle (a 5,120-row matrix is 80 programs), so the
    reduction is split (`splits`, default `dot_splits`): each part's float32 sums go to their own plane and the
    planes are added in order afterwards (deterministic: no atomics). `block_n` (output columns per program): 128,
    the fastest at 16 and 33 rows (results/gpu_nibble_dot_split_h100.json); 34-64 rows run the 33-row program
    (the same 64-row tile)."""
    rows, k = x.shape
    if k != matrix.k or not 1 <= rows <= DOT_ROWS:
        raise ValueError(f"nibble_dot takes 1 to {DOT_ROWS} rows of {matrix.k} values, not {list(x.shape)}")
    if out is None:
        out = torch.empty((rows, matrix.n), dtype=x.dtype, device=x.device)
    blocks, groups = -(-matrix.n // block_n), k // GROUP
    parts = dot_splits(blocks, groups // group_step, x.device) if splits is None else max(1, splits)
    per_part = -(-groups // parts)
    split_groups = -(-per_part // group_step) * group_step  # a whole number of steps per part
    parts = -(-groups // split_groups)
    target = out if parts == 1 else torch.empty((parts, rows, matrix.n), dtype=torch.float32, device=x.device)
    _programs().nibble_dot_kernel[(blocks, parts)](
        x.contiguous(), matrix.words.view(torch.uint8), *_scale_tensors(matrix), target, rows, matrix.n, k,
        target.stride(-2), split_groups,
        FORMAT=FORMAT_CODES[matrix.qtype], BLOCK_M=max(16, next_power_of_two(rows)), BLOCK_N=block_n,
        GROUP_STEP=group_step, PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=warps, num_stages=2,
    )
    if parts > 1:
        out.copy_(target.sum(dim=0))
    return out


def dot_splits(blocks: int, steps: int, device: torch.device) -> int:
    """How many parts to split a tensor-core product's reduction into: enough programs to give every SM
    `PROGRAMS_PER_SM` of them, no part shorter than `MIN_SPLIT_STEPS` steps."""
    wanted = -(-PROGRAMS_PER_SM * _multiprocessors(device) // blocks)
    return max(1, min(wanted, steps // MIN_SPLIT_STEPS))


@cache
def _multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # an H100's, for the interpreter
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def nibble_dequantize(
    matrix: NibbleMatrix, dtype: torch.dtype = torch.bfloat16, out: torch.Tensor | None = None,
    block_n: int = 16, group_step: int = 8, warps: int = 4,
) -> torch.Tensor:
    """The weights [n, k] in `dtype` (float32 arithmetic, rounded once), into `out` when given (contiguous)."""
    if out is None:
        out = torch.empty((matrix.n, matrix.k), dtype=dtype, device=matrix.words.device)
    if matrix.n == 0:
        return out
    grid = (-(-matrix.n // block_n), -(-(matrix.k // GROUP) // group_step))
    _programs().nibble_dequantize_kernel[grid](
        matrix.words.view(torch.uint8), *_scale_tensors(matrix), out, matrix.n, matrix.k,
        FORMAT=FORMAT_CODES[matrix.qtype], BLOCK_N=block_n, GROUP_STEP=group_step, num_warps=warps,
    )
    return out


def _scale_tensors(matrix: NibbleMatrix) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pairs, sub-scales, top bits) as the programs take them; the pairs stand in for what a format lacks."""
    sub = matrix.sub_scales if matrix.sub_scales is not None else matrix.pairs
    return matrix.pairs, sub, matrix.high_bits if matrix.high_bits is not None else matrix.words


def nibble_product(
    x: torch.Tensor, matrix: NibbleMatrix, out: torch.Tensor, quantized: QuantizedInput | None = None
) -> torch.Tensor:
    """x [rows, k] @ W^T into out [rows, n] by the path for its number of rows; `quantized` is x's rounding when
    the caller shares one between several matrices (used up to `integer_rows()` rows)."""
    rows = x.shape[0]
    if rows <= integer_rows(x.device):
        return nibble_matmul(quantized if quantized is not None else x, matrix, out=out, dtype=x.dtype)
    if rows <= DOT_ROWS:
        return nibble_dot(x, matrix, out=out)
    return out.copy_(x @ nibble_dequantize(matrix, x.dtype).T)
