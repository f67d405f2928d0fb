"""Skinny matrix products for batch-one decoding (GPU fast path): out = x @ W^T for a few rows of x.

At 1 to 64 rows a decoder's products read every weight once and do almost no arithmetic, so their time is the
weight bytes over the memory bandwidth. `skinny_linear` streams W once: each program owns `block_n` output columns
(rows of W), walks the whole reduction dimension in `block_k` steps (the loads pipelined `stages` deep) and multiplies
the tile by all of x's rows at once (tensor cores through `tl.dot`, x padded to `block_m` rows; or, for one row,
multiply-and-sum on the CUDA cores). No split of the reduction, so no second pass and no float32 scratch.
W may also be int8 with one float32 scale per row (`dflash.models.int8_linear`): the program widens each tile to
x's dtype (exact for -127..127) and scales the float32 sums once at the end, so it reads half the bytes.

`benchmarks/gpu_skinny_gemm.py` measures it against cuBLAS on chains of a model's matrices; `skinny_config` holds
what it found on an H100, and `fast_linear` is what the fused forwards call: the program where it serves, cuBLAS
elsewhere (more than 64 rows, the CPU, float32, strided operands) or everywhere with DFLASH_PRODUCTS=cublas.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Any

import torch
import torch.nn.functional as F

from dflash import environment
from dflash.kernels.triton_decode import interpreting

MAX_ROWS = 64


@dataclass(frozen=True)
class SkinnyConfig:
    block_n: int = 32
    block_k: int = 256
    warps: int = 4
    stages: int = 3
    use_dot: bool = True  # False: multiply-and-sum, one row only


@cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def skinny_kernel(  # type: ignore[no-untyped-def]
        x_ptr, w_ptr, scale_ptr, out_ptr, rows, n, k,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_DOT: tl.constexpr,
        EVEN_K: tl.constexpr, PRECISION: tl.constexpr, SCALED: tl.constexpr,
    ):
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] output columns = rows of W
        cols_inside = cols < n
        w_rows = w_ptr + cols.to(tl.int64)[:, None] * k  # [BLOCK_N, 1]
        reach = tl.arange(0, BLOCK_K)
        if USE_DOT:
            row_ids = tl.arange(0, BLOCK_M)
            rows_inside = row_ids < rows
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for start in range(0, k, BLOCK_K):
                ks = start + reach
                ks_inside = reach >= 0 if EVEN_K else ks < k
                w = tl.load(w_rows + ks[None, :], mask=cols_inside[:, None] & ks_inside[None, :], other=0)  # [BN, BK]
                x = tl.load(
                    x_ptr + row_ids[:, None] * k + ks[None, :], mask=rows_inside[:, None] & ks_inside[None, :],
                    other=0.0,
                )  # [BM, BK]
                acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc, input_precision=PRECISION)
            if SCALED:
                acc = acc * tl.load(scale_ptr + cols, mask=cols_inside, other=0.0)[None, :]
            tl.store(
                out_ptr + row_ids[:, None] * n + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                mask=rows_inside[:, None] & cols_inside[None, :],
            )
        else:
            total = tl.zeros((BLOCK_N,), dtype=tl.float32)
            for start in range(0, k, BLOCK_K):
                ks = start + reach
                ks_inside = reach >= 0 if EVEN_K else ks < k
                w = tl.load(w_rows + ks[None, :], mask=cols_inside[:, None] & ks_inside[None, :], other=0)  # [BN, BK]
                x = tl.load(x_ptr + ks, mask=ks_inside, other=0.0).to(tl.float32)  # [BK]
                total += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
            if SCALED:
                total = total * tl.load(scale_ptr + cols, mask=cols_inside, other=0.0)
            tl.store(out_ptr + cols, total.to(out_ptr.dtype.element_ty), mask=cols_inside)

    return skinny_kernel


def skinny_usable(rows: int, config: SkinnyConfig) -> bool:
    """Whether `skinny_linear` serves `rows` rows of x with `config`."""
    return rows <= MAX_ROWS if config.use_dot else rows == 1


def skinny_config(rows: int, k: int, int8: bool = False, gpu: str = "", n: int = 0) -> SkinnyConfig | None:
    """The configuration for x [rows, k] times W [n, k]^T, from the H100 grids (`results/gpu_skinny_gemm_h100_*.json`):
    one row multiplies and sums on the CUDA cores in long steps; 2-64 rows go through tensor cores, in longer steps
    for a wide reduction; int8 rows past 16 in narrower tiles (`..._qwen3_8b_drafter_int8.json`). None past
    `MAX_ROWS` rows (cuBLAS's tiles win there). `gpu` "H200" (`gpu_model`): one row of a wide reduction in shorter
    steps with fewer warps, by the matrix's shape (`results/gpu_skinny_gemm_one_row_h200.json`, over Qwen3-8B,
    Qwen3-32B and a 32B rank's matrices: within 5% of the best configuration per matrix, where one choice for all
    was up to 13% off): its more bandwidth wants more, smaller loads in flight."""
    wide = k >= 4096
    if rows == 1:
        if wide and gpu == "H200":
            return _one_row_h200(n, k)
        return SkinnyConfig(8, 2048, 16, 2, False) if wide else SkinnyConfig(4, 1024, 8, 2, False)
    if rows <= 16:
        return SkinnyConfig(32, 512 if wide else 128, 4, 4)
    if rows <= MAX_ROWS:
        if int8 and wide:
            return SkinnyConfig(16, 256, 4, 3)
        return SkinnyConfig(32, 256 if wide else 128, 4, 4)
    return None


def _one_row_h200(n: int, k: int) -> SkinnyConfig:
    """One row of a wide reduction on an H200: many outputs (gate/up, LM head) in 8-column tiles of 512-wide steps;
    a long reduction (MLP down) in 2,048-wide steps (1,024 ones leave a masked tail on 12,800 and took 13% longer
    there); the rest (QKV, attention output) 4 columns, 1,024-wide steps."""
    if n >= 4 * k:
        return SkinnyConfig(8, 512, 4, 2, False)
    if k >= 8192:
        return SkinnyConfig(4, 2048, 4, 1, False)
    return SkinnyConfig(4, 1024, 4, 2, False)


def gpu_model(device: torch.device) -> str:
    """"H200" on an H200, "" elsewhere (the H100's configurations apply)."""
    return _gpu_model(device.index or 0) if device.type == "cuda" else ""


@cache
def _gpu_model(index: int) -> str:
    return "H200" if "H200" in torch.cuda.get_device_name(index) else ""


def skinny_products_enabled() -> bool:
    """DFLASH_PRODUCTS=skinny (the default) or cublas; read when a forward runs (so when a graph is captured)."""
    return environment.products() == "skinny"


def fast_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, scales: torch.Tensor | None = None
) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [rows, K]: through `skinny_linear` where it serves (CUDA, 16-bit floats,
    contiguous operands, at most `MAX_ROWS` rows; any device and float type under TRITON_INTERPRET=1, for the CPU
    tests), else cuBLAS. With `scales` [N] (float32), `weight` is int8 and the product is
    x @ (weight * scales[:, None])^T; where the program does not serve, the int8 matrix is widened for the call."""
    config = skinny_config(
        x.shape[0], x.shape[1], int8=scales is not None, gpu=gpu_model(x.device), n=weight.shape[0]
    )
    on_device = x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)
    weight_dtype = torch.int8 if scales is not None else x.dtype
    if (
        config is None
        or not (on_device or interpreting())
        or weight.dtype != weight_dtype
        or not (x.is_contiguous() and weight.is_contiguous())
        or not skinny_products_enabled()
    ):
        if scales is None:
            return F.linear(x, weight, bias)
        out = F.linear(x, weight.to(x.dtype)).mul_(scales.to(x.dtype))
        return out if bias is None else out.add_(bias)
    out = skinny_linear(x, weight, config, scales)
    return out if bias is None else out.add_(bias)


def skinny_linear(
    x: torch.Tensor, weight: torch.Tensor, config: SkinnyConfig = SkinnyConfig(), scales: torch.Tensor | None = None
) -> torch.Tensor:
    """x: [rows, K] contiguous, weight: [N, K] contiguous, same dtype (or int8 with `scales` [N], float32 best) ->
    x @ weight^T [rows, N] (float32 accumulation, scaled per output column, rounded once to x's dtype)."""
    rows, k = x.shape
    n = weight.shape[0]
    if not skinny_usable(rows, config):
        raise ValueError(f"skinny_linear does not serve {rows} rows with {config}")
    if scales is not None and (weight.dtype != torch.int8 or not scales.is_floating_point() or scales.shape != (n,)):
        raise ValueError("scaled products take an int8 weight [N, K] and float scales [N]")
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    block_m = max(16, 1 << max(0, rows - 1).bit_length())
    _kernel()[(-(-n // config.block_n),)](
        x, weight, weight if scales is None else scales, out, rows, n, k,
        BLOCK_M=block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, USE_DOT=config.use_dot,
        EVEN_K=k % config.block_k == 0, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        SCALED=scales is not None, num_warps=config.warps, num_stages=config.stages,
    )
    return out
