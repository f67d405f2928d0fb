"""Triton kernels that fuse the small element-wise steps of a decoder layer (GPU fast path).

At batch one a decoder layer is a handful of matrix products surrounded by dozens of tiny element-wise kernels
(RMSNorm alone is seven: cast, square, mean, add, rsqrt, multiply, scale). Each costs a launch, which dominates a
small model's step. These kernels do each group in one launch:

* `add_rms_norm`: residual add and RMSNorm (float32 statistics, the eager path's rounding points);
* `rope_and_store`: optional per-head q/k RMSNorm, rotary embedding of q (in place) and k, and the store of k and v
  into their cache slots;
* `silu_and_mul`: SiLU(gate) * up of the fused gate/up projection.

Triton is imported lazily: without it (or on a CPU without the interpreter) `triton_available()` is False and the
fast path keeps the unfused static forward.
"""

from __future__ import annotations

import os
from functools import cache
from typing import Any

import torch


@cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def interpreting() -> bool:
    """Kernels run on the CPU through Triton's interpreter (TRITON_INTERPRET=1), for tests without a GPU."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def next_power_of_two(value: int) -> int:
    return 1 << max(0, value - 1).bit_length()


@cache
def _kernels() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def add_rms_norm_kernel(
        x_ptr, residual_ptr, weight_ptr, out_ptr, sum_ptr, width, eps,
        HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, ADDS_ONE: tl.constexpr = False,
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        inside = cols < width
        x = tl.load(x_ptr + row * width + cols, mask=inside, other=0.0)
        if HAS_RESIDUAL:
            added = x.to(tl.float32) + tl.load(residual_ptr + row * width + cols, mask=inside, other=0.0).to(tl.float32)
            x = added.to(x_ptr.dtype.element_ty)
            tl.store(sum_ptr + row * width + cols, x, mask=inside)
        x32 = x.to(tl.float32)
        inverse_rms = 1.0 / tl.sqrt(tl.sum(x32 * x32, axis=0) / width + eps)
        weight = tl.load(weight_ptr + cols, mask=inside, other=0.0).to(tl.float32)
        if ADDS_ONE:  # (1 + weight) applied in float32 before rounding, as `RMSNorm(adds_one=True)` does
            scaled = x32 * inverse_rms * (1.0 + weight)
        else:  # normalised, rounded to the input's dtype, then weighted, as `RMSNorm` does
            scaled = (x32 * inverse_rms).to(x_ptr.dtype.element_ty).to(tl.float32) * weight
        tl.store(out_ptr + row * width + cols, scaled.to(out_ptr.dtype.element_ty), mask=inside)

    @triton.jit
    def rope_and_store_kernel(
        qkv_ptr, cos_ptr, sin_ptr, q_weight_ptr, k_weight_ptr, key_cache_ptr, value_cache_ptr, slots_ptr,
        num_heads, num_kv_heads, capacity, eps,
        HEAD_DIM: tl.constexpr, HALF: tl.constexpr, QK_NORM: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        width = (num_heads + 2 * num_kv_heads) * HEAD_DIM
        half = tl.arange(0, HALF)
        base = row * width + head * HEAD_DIM
        first = tl.load(qkv_ptr + base + half)
        second = tl.load(qkv_ptr + base + HALF + half)
        dtype = first.dtype
        x1 = first.to(tl.float32)
        x2 = second.to(tl.float32)
        if QK_NORM:
            inverse_rms = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / HEAD_DIM + eps)
            is_query = head < num_heads
            w1 = tl.where(is_query, tl.load(q_weight_ptr + half), tl.load(k_weight_ptr + half)).to(tl.float32)
            w2 = tl.where(is_query, tl.load(q_weight_ptr + HALF + half), tl.load(k_weight_ptr + HALF + half))
            x1 = ((x1 * inverse_rms).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
            x2 = ((x2 * inverse_rms).to(dtype).to(tl.float32) * w2.to(tl.float32)).to(dtype).to(tl.float32)
        cos1 = tl.load(cos_ptr + row * HEAD_DIM + half).to(tl.float32)
        cos2 = tl.load(cos_ptr + row * HEAD_DIM + HALF + half).to(tl.float32)
        sin1 = tl.load(sin_ptr + row * HEAD_DIM + half).to(tl.float32)
        sin2 = tl.load(sin_ptr + row * HEAD_DIM + HALF + half).to(tl.float32)
        out1 = (x1 * cos1 - x2 * sin1).to(dtype)
        out2 = (x2 * cos2 + x1 * sin2).to(dtype)
        if head < num_heads:
            tl.store(qkv_ptr + base + half, out1)
            tl.store(qkv_ptr + base + HALF + half, out2)
        else:
            slot = tl.load(slots_ptr + row)
            if slot >= 0:  # a negative slot: the row's k and v are not stored
                kv_head = head - num_heads
                target = (kv_head * capacity + slot) * HEAD_DIM
                tl.store(key_cache_ptr + target + half, out1)
                tl.store(key_cache_ptr + target + HALF + half, out2)
                value = row * width + (num_heads + num_kv_heads + kv_head) * HEAD_DIM
                tl.store(value_cache_ptr + target + half, tl.load(qkv_ptr + value + half))
                tl.store(value_cache_ptr + target + HALF + half, tl.load(qkv_ptr + value + HALF + half))

    @triton.jit
    def silu_and_mul_kernel(gate_up_ptr, out_ptr, inner, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = cols < inner
        gate = tl.load(gate_up_ptr + row * 2 * inner + cols, mask=inside, other=0.0).to(tl.float32)
        up = tl.load(gate_up_ptr + row * 2 * inner + inner + cols, mask=inside, other=0.0)
        activated = (gate * tl.sigmoid(gate)).to(up.dtype).to(tl.float32)
        tl.store(out_ptr + row * inner + cols, (activated * up.to(tl.float32)).to(up.dtype), mask=inside)

    return add_rms_norm_kernel, rope_and_store_kernel, silu_and_mul_kernel


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, *,
    out: torch.Tensor | None = None, adds_one: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual: [rows, width] contiguous -> (RMSNorm(x + residual) * weight, x + residual); without a
    residual the second output is x itself. `out` ([rows, width] contiguous, x's dtype) receives the first.
    `adds_one`: scaled by (1 + weight) (Gemma's and Qwen3.5's norms)."""
    add_kernel = _kernels()[0]
    rows, width = x.shape
    if out is None:
        out = torch.empty_like(x)
    elif out.shape != x.shape or out.dtype != x.dtype or not out.is_contiguous():
        raise ValueError(f"add_rms_norm out must be a contiguous {tuple(x.shape)} {x.dtype} tensor")
    summed = torch.empty_like(x) if residual is not None else x
    add_kernel[(rows,)](
        x, residual if residual is not None else x, weight, out, summed, width, eps,
        HAS_RESIDUAL=residual is not None, BLOCK=next_power_of_two(width), ADDS_ONE=adds_one,
    )
    return out, summed


def rope_and_store(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slots: torch.Tensor,
    *,
    num_heads: int,
    num_kv_heads: int,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> None:
    """qkv: [rows, (heads + 2 kv_heads) * head_dim] contiguous, q rotated in place; cos, sin: [rows, head_dim];
    key_cache, value_cache: [kv_heads, capacity, head_dim] contiguous (one layer); slots: [rows] long, where each
    row's rotated k and its v are stored (a negative slot stores nothing). With norm weights, q and k heads are RMS-normalised first (Qwen3)."""
    rope_kernel = _kernels()[1]
    rows = qkv.shape[0]
    head_dim = cos.shape[-1]
    norm = q_norm_weight is not None and k_norm_weight is not None
    rope_kernel[(rows, num_heads + num_kv_heads)](
        qkv, cos, sin, q_norm_weight if norm else cos, k_norm_weight if norm else cos, key_cache, value_cache, slots,
        num_heads, num_kv_heads, key_cache.shape[1], eps,
        HEAD_DIM=head_dim, HALF=head_dim // 2, QK_NORM=norm,
    )


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [rows, 2 * inner] contiguous -> SiLU(gate) * up [rows, inner]."""
    silu_kernel = _kernels()[2]
    rows, double = gate_up.shape
    inner = double // 2
    out = torch.empty((rows, inner), dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, next_power_of_two(inner))
    silu_kernel[(rows, -(-inner // block))](gate_up, out, inner, BLOCK=block)
    return out
