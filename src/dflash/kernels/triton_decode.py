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

# high, low, scale, total, half_total: where a fused program writes its rows' 8-bit parts (`QuantizedInput`)
RoundingOutputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


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
    from dflash.kernels import triton_decode_programs as programs  # Triton is imported only here

    return programs.add_rms_norm_kernel, programs.rope_and_store_kernel, programs.silu_and_mul_kernel


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
        x, residual if residual is not None else x, weight, out, summed, width, eps, *_no_rounding(x),
        HAS_RESIDUAL=residual is not None, BLOCK=next_power_of_two(width), ADDS_ONE=adds_one,
    )
    return out, summed


def add_rms_norm_rounded(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, rounded: RoundingOutputs,
    parts: int, *, adds_one: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`add_rms_norm`, and in the same program the normed rows rounded to `parts` 8-bit parts per group of 32 into
    `rounded` (high, low, scale, total, half_total: `QuantizedInput`'s arrays for these rows), exactly as
    `quantize_input` rounds them. width: a multiple of 32."""
    add_kernel = _kernels()[0]
    rows, width = x.shape
    out = torch.empty_like(x)
    summed = torch.empty_like(x) if residual is not None else x
    add_kernel[(rows,)](
        x, residual if residual is not None else x, weight, out, summed, width, eps, *rounded,
        HAS_RESIDUAL=residual is not None, BLOCK=next_power_of_two(width), ADDS_ONE=adds_one, ROUND=True,
        PARTS=parts,
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
    silu_kernel[(rows, -(-inner // block))](gate_up, out, inner, *_no_rounding(gate_up), BLOCK=block)
    return out


def silu_and_mul_rounded(gate_up: torch.Tensor, rounded: RoundingOutputs, parts: int) -> torch.Tensor:
    """`silu_and_mul`, and in the same programs its rows rounded to `parts` 8-bit parts per group of 32 into
    `rounded` (as `add_rms_norm_rounded`). inner: a multiple of 32."""
    silu_kernel = _kernels()[2]
    rows, double = gate_up.shape
    inner = double // 2
    out = torch.empty((rows, inner), dtype=gate_up.dtype, device=gate_up.device)
    block = max(32, min(1024, next_power_of_two(inner)))
    silu_kernel[(rows, -(-inner // block))](gate_up, out, inner, *rounded, BLOCK=block, ROUND=True, PARTS=parts)
    return out


def _no_rounding(like: torch.Tensor) -> RoundingOutputs:
    """Placeholders for the rounding outputs of a program that does not round (never written)."""
    return (like, like, like, like, like)
