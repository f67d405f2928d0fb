"""The Triton programs of `dflash.kernels.triton_decode` (imported only where Triton is installed)."""

from __future__ import annotations

import triton
import triton.language as tl

from dflash.kernels.triton_gguf_int8_programs import round_groups


@triton.jit
def add_rms_norm_kernel(  # type: ignore[no-untyped-def]
    x_ptr, residual_ptr, weight_ptr, out_ptr, sum_ptr, width, eps,
    high_ptr, low_ptr, scale_ptr, total_ptr, half_total_ptr,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, ADDS_ONE: tl.constexpr = False,
    ROUND: tl.constexpr = False, PARTS: tl.constexpr = 2,
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
    normed = scaled.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * width + cols, normed, mask=inside)
    if ROUND:  # the stored row rounded for the integer products that read it (width: whole groups of 32)
        groups = tl.arange(0, BLOCK // 32)
        tile = tl.reshape(normed.to(tl.float32), (BLOCK // 32, 32))
        round_groups(tile, row, groups, width, high_ptr, low_ptr, scale_ptr, total_ptr, half_total_ptr,
                     BLOCK // 32, PARTS)


@triton.jit
def rope_and_store_kernel(  # type: ignore[no-untyped-def]
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
def silu_and_mul_kernel(  # type: ignore[no-untyped-def]
    gate_up_ptr, out_ptr, inner, high_ptr, low_ptr, scale_ptr, total_ptr, half_total_ptr,
    BLOCK: tl.constexpr, ROUND: tl.constexpr = False, PARTS: tl.constexpr = 2,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < inner
    gate = tl.load(gate_up_ptr + row * 2 * inner + cols, mask=inside, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * 2 * inner + inner + cols, mask=inside, other=0.0)
    activated = (gate * tl.sigmoid(gate)).to(up.dtype).to(tl.float32)
    product = (activated * up.to(tl.float32)).to(up.dtype)
    tl.store(out_ptr + row * inner + cols, product, mask=inside)
    if ROUND:  # this block's groups rounded for the down projection's integer products (BLOCK: whole groups)
        groups = tl.program_id(1) * (BLOCK // 32) + tl.arange(0, BLOCK // 32)
        tile = tl.reshape(product.to(tl.float32), (BLOCK // 32, 32))
        round_groups(tile, row, groups, inner, high_ptr, low_ptr, scale_ptr, total_ptr, half_total_ptr,
                     BLOCK // 32, PARTS)
