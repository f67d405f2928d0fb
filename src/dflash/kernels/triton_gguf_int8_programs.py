"""The Triton programs of `dflash.kernels.triton_gguf_int8` (imported only where Triton is installed)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def quantize_kernel(  # type: ignore[no-untyped-def]
    x_ptr, high_ptr, low_ptr, scale_ptr, total_ptr, half_total_ptr, k, GROUPS: tl.constexpr, PARTS: tl.constexpr = 2
):
    """One program per (row, GROUPS groups): rounds x to PARTS 8-bit parts per group of 32 (one part: high alone,
    x ~ dx high; two: x ~ dx (256 high + low))."""
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)  # [G]
    cols = g[:, None] * 32 + tl.arange(0, 32)[None, :]  # [G, 32]
    x = tl.load(x_ptr + row * k + cols, mask=cols < k, other=0.0).to(tl.float32)
    round_groups(x, row, g, k, high_ptr, low_ptr, scale_ptr, total_ptr, half_total_ptr, GROUPS, PARTS)


@triton.jit
def round_groups(  # type: ignore[no-untyped-def]
    x, row, g, k, high_ptr, low_ptr, scale_ptr, total_ptr, half_total_ptr, GROUPS: tl.constexpr, PARTS: tl.constexpr
):
    """x: float32 [GROUPS, 32], groups g [GROUPS] of row `row` (of k values; groups past its end are not stored)
    -> their PARTS 8-bit parts, scales and sums (`QuantizedInput`'s arrays). `quantize_kernel` and the fused
    add+RMSNorm and SiLU programs (`dflash.kernels.triton_decode`) all round through this one function, so a value
    rounded in a fused program is rounded exactly as `quantize_input` rounds it."""
    cols = g[:, None] * 32 + tl.arange(0, 32)[None, :]  # [G, 32]
    inside = cols < k
    amax = tl.max(tl.abs(x), axis=1)  # [G]
    d = amax / 127.0
    inverse = tl.where(amax > 0, 127.0 / tl.maximum(amax, 1e-30), 0.0)
    high = tl.floor(x * inverse[:, None] + 0.5)  # [G, 32] in [-127, 127]
    high_i = high.to(tl.int32)
    tl.store(high_ptr + row * k + cols, high_i.to(tl.int8), mask=inside)
    if PARTS == 2:
        residual = x - d[:, None] * high
        low = tl.minimum(tl.maximum(tl.floor(residual * (inverse[:, None] * 256.0) + 0.5), -127.0), 127.0)
        low_i = low.to(tl.int32)
        tl.store(low_ptr + row * k + cols, low_i.to(tl.int8), mask=inside)
        scale = d / 256.0
        both = 256 * high_i + low_i  # [G, 32]
    else:
        scale = d
        both = high_i
    groups = tl.cdiv(k, 32)
    tl.store(scale_ptr + row * groups + g, scale, mask=g < groups)
    total = tl.sum(both, axis=1).to(tl.float32) * scale
    tl.store(total_ptr + row * groups + g, total, mask=g < groups)
    halves = tl.sum(tl.reshape(both, (GROUPS, 2, 16)), axis=2).to(tl.float32) * scale[:, None]  # [G, 2]
    h = g[:, None] * 2 + tl.arange(0, 2)[None, :]
    tl.store(half_total_ptr + row * groups * 2 + h, halves, mask=h < groups * 2)


@triton.jit
def dp4a(a, b, c, EMULATE: tl.constexpr):  # type: ignore[no-untyped-def]
    """c + the dot product of a's and b's four signed bytes (int32 words)."""
    if EMULATE:
        total = c
        for i in tl.static_range(4):
            total += ((a << (24 - 8 * i)) >> 24) * ((b << (24 - 8 * i)) >> 24)
        return total
    else:
        return tl.inline_asm_elementwise(
            "dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=tl.int32, is_pure=True, pack=1
        )


@triton.jit
def group_scales(pairs_ptr, sub_ptr, cols, cols_inside, g, g_inside, groups, FORMAT: tl.constexpr):  # type: ignore[no-untyped-def]
    """Each (weight row, group)'s scale and min, float32 [BN, GS]: w = scale q + min for the group's 4-bit q.
    `cols`: the weight rows, int64 where the matrix needs 64-bit offsets."""
    g_row = cols[:, None] * groups + g[None, :]  # [BN, GS]
    inside = cols_inside[:, None] & g_inside[None, :]
    if FORMAT == 2:  # Q4_K: d scale q - dmin min
        block_at = cols[:, None] * (groups // 8) + g[None, :] // 8
        d = tl.load(pairs_ptr + block_at * 2, mask=inside, other=0.0).to(tl.float32)
        dmin = tl.load(pairs_ptr + block_at * 2 + 1, mask=inside, other=0.0).to(tl.float32)
        sub_scale = tl.load(sub_ptr + g_row * 2, mask=inside, other=0).to(tl.float32)
        sub_min = tl.load(sub_ptr + g_row * 2 + 1, mask=inside, other=0).to(tl.float32)
        return d * sub_scale, -(dmin * sub_min)
    elif FORMAT == 1:  # Q4_1: d q + m
        scale = tl.load(pairs_ptr + g_row * 2, mask=inside, other=0.0).to(tl.float32)
        return scale, tl.load(pairs_ptr + g_row * 2 + 1, mask=inside, other=0.0).to(tl.float32)
    else:  # Q4_0: d (q - 8)
        scale = tl.load(pairs_ptr + g_row, mask=inside, other=0.0).to(tl.float32)
        return scale, -8.0 * scale


@triton.jit
def nibble_matmul_kernel(  # type: ignore[no-untyped-def]
    high_ptr, low_ptr, scale_ptr, total_ptr, words_ptr, pairs_ptr, sub_ptr, out_ptr,
    rows, n, k, out_stride,
    FORMAT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_STEP: tl.constexpr,
    EMULATE: tl.constexpr, PARTS: tl.constexpr = 2, WIDE: tl.constexpr = True,
):
    """out[rows, n] = x @ W^T: each program owns BLOCK_N rows of W and walks them GROUP_STEP groups at a
    time, every group's 4 words against each input row's 8 words of each of its PARTS parts. WIDE: 64-bit offsets
    into the matrix (only a matrix of 2^31 words or more needs them: they cost instructions)."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    cols_inside = cols < n
    if WIDE:  # noqa: SIM108 (a constexpr branch)
        rows_at = cols.to(tl.int64)
    else:
        rows_at = cols
    groups = k // 32
    m = tl.arange(0, BLOCK_M)  # [BM]
    m_inside = m < rows
    u = tl.arange(0, 4)  # a group's words
    acc = tl.zeros((BLOCK_M, BLOCK_N, GROUP_STEP), dtype=tl.float32)
    for first in range(0, groups, GROUP_STEP):
        g = first + tl.arange(0, GROUP_STEP)  # [GS]
        g_inside = g < groups
        w_mask = cols_inside[:, None, None] & g_inside[None, :, None]  # [BN, GS, 1]
        words = tl.load(
            words_ptr + rows_at[:, None, None] * (k // 8) + g[None, :, None] * 4 + u[None, None, :],
            mask=w_mask, other=0,
        )  # [BN, GS, 4]: values 4u..4u+3 in the low nibbles, 16+4u.. in the high ones
        first_half = words & 0x0F0F0F0F
        second_half = (words >> 4) & 0x0F0F0F0F
        x_mask = m_inside[:, None, None] & g_inside[None, :, None]  # [BM, GS, 1]
        x_at = m[:, None, None] * (k // 4) + g[None, :, None] * 8 + u[None, None, :]  # [BM, GS, 4]
        a1 = tl.broadcast_to(first_half[None, :, :, :], (BLOCK_M, BLOCK_N, GROUP_STEP, 4))
        a2 = tl.broadcast_to(second_half[None, :, :, :], (BLOCK_M, BLOCK_N, GROUP_STEP, 4))
        zero = tl.zeros((BLOCK_M, BLOCK_N, GROUP_STEP, 4), dtype=tl.int32)
        b1 = tl.broadcast_to(tl.load(high_ptr + x_at, mask=x_mask, other=0)[:, None, :, :], (BLOCK_M, BLOCK_N, GROUP_STEP, 4))
        b2 = tl.broadcast_to(tl.load(high_ptr + x_at + 4, mask=x_mask, other=0)[:, None, :, :], (BLOCK_M, BLOCK_N, GROUP_STEP, 4))
        dot = dp4a(a2, b2, dp4a(a1, b1, zero, EMULATE), EMULATE)
        if PARTS == 2:
            b1 = tl.broadcast_to(tl.load(low_ptr + x_at, mask=x_mask, other=0)[:, None, :, :], (BLOCK_M, BLOCK_N, GROUP_STEP, 4))
            b2 = tl.broadcast_to(tl.load(low_ptr + x_at + 4, mask=x_mask, other=0)[:, None, :, :], (BLOCK_M, BLOCK_N, GROUP_STEP, 4))
            dot = dot * 256 + dp4a(a2, b2, dp4a(a1, b1, zero, EMULATE), EMULATE)
        isum = tl.sum(dot, axis=3).to(tl.float32)  # [BM, BN, GS], exact below 2^24
        w_scale, w_min = group_scales(pairs_ptr, sub_ptr, rows_at, cols_inside, g, g_inside, groups, FORMAT)
        xg = m[:, None] * groups + g[None, :]  # [BM, GS]
        xg_mask = m_inside[:, None] & g_inside[None, :]
        dx = tl.load(scale_ptr + xg, mask=xg_mask, other=0.0)
        sx = tl.load(total_ptr + xg, mask=xg_mask, other=0.0)
        acc += (w_scale[None, :, :] * dx[:, None, :]) * isum + w_min[None, :, :] * sx[:, None, :]
    out = tl.sum(acc, axis=2)  # [BM, BN]
    tl.store(
        out_ptr + m[:, None] * out_stride + cols[None, :], out.to(out_ptr.dtype.element_ty),
        mask=m_inside[:, None] & cols_inside[None, :],
    )


@triton.jit
def group_values(  # type: ignore[no-untyped-def]
    bytes_ptr, pairs_ptr, sub_ptr, highs_ptr, cols, cols_inside, g, g_inside, k, FORMAT: tl.constexpr
):
    """The weights of groups g of rows cols, float32: (values 0..15, values 16..31) of each group, [BN, GS, 16]
    each, from the group's 16 bytes (byte t: value t low, t + 16 high; Q6_K: their top bits from `high_bits`)."""
    t = tl.arange(0, 16)
    inside = cols_inside[:, None, None] & g_inside[None, :, None]
    raw = tl.load(
        bytes_ptr + cols.to(tl.int64)[:, None, None] * (k // 2) + g[None, :, None] * 16 + t[None, None, :],
        mask=inside, other=0,
    ).to(tl.int32)  # [BN, GS, 16]
    if FORMAT == 3:  # Q6_K: d scale (q - 32), one int8 scale per half
        halves = cols.to(tl.int64)[:, None] * (k // 16) + g[None, :] * 2  # [BN, GS]: the first half's index
        row_inside = cols_inside[:, None] & g_inside[None, :]
        shift = 2 * (t // 4) + 8 * (t % 4)  # value t's top bits in its half's word
        top_first = (tl.load(highs_ptr + halves, mask=row_inside, other=0)[:, :, None] >> shift[None, None, :]) & 3
        top_second = (tl.load(highs_ptr + halves + 1, mask=row_inside, other=0)[:, :, None] >> shift[None, None, :]) & 3
        d = tl.load(pairs_ptr + cols.to(tl.int64)[:, None] * (k // 256) + g[None, :] // 8, mask=row_inside, other=0.0)
        first_scale = d.to(tl.float32) * tl.load(sub_ptr + halves, mask=row_inside, other=0).to(tl.int8).to(tl.float32)
        second_scale = d.to(tl.float32) * tl.load(sub_ptr + halves + 1, mask=row_inside, other=0).to(tl.int8).to(
            tl.float32)
        low = ((raw & 15) | (top_first << 4)) - 32
        high = ((raw >> 4) | (top_second << 4)) - 32
        return low.to(tl.float32) * first_scale[:, :, None], high.to(tl.float32) * second_scale[:, :, None]
    else:
        scale, minimum = group_scales(pairs_ptr, sub_ptr, cols.to(tl.int64), cols_inside, g, g_inside, k // 32, FORMAT)
        low = (raw & 15).to(tl.float32) * scale[:, :, None] + minimum[:, :, None]
        high = (raw >> 4).to(tl.float32) * scale[:, :, None] + minimum[:, :, None]
        return low, high


@triton.jit
def nibble_dot_kernel(  # type: ignore[no-untyped-def]
    x_ptr, bytes_ptr, pairs_ptr, sub_ptr, highs_ptr, out_ptr, rows, n, k, out_stride, split_groups,
    FORMAT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_STEP: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """out[rows, n] = x @ W^T on tensor cores: each step's weights dequantised in registers to x's dtype as two
    tiles (every group's first and second 16 values), each against the matching columns of x. Program (i, s)
    sums groups s * split_groups .. (s + 1) * split_groups - 1 of its columns into plane s of out ([splits, rows,
    n] partial sums when split, out itself when not)."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    cols_inside = cols < n
    m = tl.arange(0, BLOCK_M)
    m_inside = m < rows
    t = tl.arange(0, 16)
    split = tl.program_id(1)
    out_ptr += split.to(tl.int64) * rows * out_stride
    start = split * split_groups
    stop = tl.minimum(start + split_groups, k // 32)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for first in range(start, stop, GROUP_STEP):
        g = first + tl.arange(0, GROUP_STEP)
        g_inside = g < stop
        low, high = group_values(bytes_ptr, pairs_ptr, sub_ptr, highs_ptr, cols, cols_inside, g, g_inside, k, FORMAT)
        x_at = m.to(tl.int64)[:, None, None] * k + g[None, :, None] * 32 + t[None, None, :]  # [BM, GS, 16]
        x_mask = m_inside[:, None, None] & g_inside[None, :, None]
        x_first = tl.reshape(tl.load(x_ptr + x_at, mask=x_mask, other=0.0), (BLOCK_M, GROUP_STEP * 16))
        x_second = tl.reshape(tl.load(x_ptr + x_at + 16, mask=x_mask, other=0.0), (BLOCK_M, GROUP_STEP * 16))
        tile = tl.reshape(low, (BLOCK_N, GROUP_STEP * 16)).to(x_first.dtype)
        acc = tl.dot(x_first, tl.trans(tile), acc, input_precision=PRECISION)
        tile = tl.reshape(high, (BLOCK_N, GROUP_STEP * 16)).to(x_first.dtype)
        acc = tl.dot(x_second, tl.trans(tile), acc, input_precision=PRECISION)
    tl.store(
        out_ptr + m[:, None] * out_stride + cols[None, :], acc.to(out_ptr.dtype.element_ty),
        mask=m_inside[:, None] & cols_inside[None, :],
    )


@triton.jit
def nibble_dequantize_kernel(  # type: ignore[no-untyped-def]
    bytes_ptr, pairs_ptr, sub_ptr, highs_ptr, out_ptr, n, k,
    FORMAT: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_STEP: tl.constexpr,
):
    """out[n, k] = W in out's dtype: program (i, s) writes rows i * BLOCK_N.. of groups s * GROUP_STEP..."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols_inside = cols < n
    g = tl.program_id(1) * GROUP_STEP + tl.arange(0, GROUP_STEP)
    g_inside = g < k // 32
    low, high = group_values(bytes_ptr, pairs_ptr, sub_ptr, highs_ptr, cols, cols_inside, g, g_inside, k, FORMAT)
    t = tl.arange(0, 16)
    at = out_ptr + cols.to(tl.int64)[:, None, None] * k + g[None, :, None] * 32 + t[None, None, :]
    inside = cols_inside[:, None, None] & g_inside[None, :, None]
    tl.store(at, low.to(out_ptr.dtype.element_ty), mask=inside)
    tl.store(at + 16, high.to(out_ptr.dtype.element_ty), mask=inside)


@triton.jit
def six_bit_matmul_kernel(  # type: ignore[no-untyped-def]
    high_ptr, low_ptr, scale_ptr, half_total_ptr, words_ptr, highs_ptr, d_ptr, sub_ptr, out_ptr,
    rows, n, k, out_stride,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_STEP: tl.constexpr, EMULATE: tl.constexpr,
    PARTS: tl.constexpr = 2, WIDE: tl.constexpr = True,
):
    """`nibble_matmul_kernel` for Q6_K: each word's nibbles joined with their top bits (values 0..63) before the
    dot products, one integer sum per 16 values (each has its own scale), w = d scale (q - 32)."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    cols_inside = cols < n
    if WIDE:  # noqa: SIM108 (a constexpr branch)
        rows_at = cols.to(tl.int64)
    else:
        rows_at = cols
    groups = k // 32
    m = tl.arange(0, BLOCK_M)
    m_inside = m < rows
    u = tl.arange(0, 4)
    acc = tl.zeros((BLOCK_M, BLOCK_N, GROUP_STEP), dtype=tl.float32)
    for first in range(0, groups, GROUP_STEP):
        g = first + tl.arange(0, GROUP_STEP)
        g_inside = g < groups
        w_mask = cols_inside[:, None, None] & g_inside[None, :, None]
        words = tl.load(
            words_ptr + rows_at[:, None, None] * (k // 8) + g[None, :, None] * 4 + u[None, None, :],
            mask=w_mask, other=0,
        )  # [BN, GS, 4]
        halves = rows_at[:, None, None] * (k // 16) + g[None, :, None] * 2  # [BN, GS, 1]
        top_first = tl.load(highs_ptr + halves, mask=w_mask, other=0)
        top_second = tl.load(highs_ptr + halves + 1, mask=w_mask, other=0)
        first_half = (words & 0x0F0F0F0F) | (((top_first >> (2 * u[None, None, :])) & 0x03030303) << 4)
        second_half = ((words >> 4) & 0x0F0F0F0F) | (((top_second >> (2 * u[None, None, :])) & 0x03030303) << 4)
        x_mask = m_inside[:, None, None] & g_inside[None, :, None]
        x_at = m[:, None, None] * (k // 4) + g[None, :, None] * 8 + u[None, None, :]
        a1 = tl.broadcast_to(first_half[None, :, :, :], (BLOCK_M, BLOCK_N, GROUP_STEP, 4))
        a2 = tl.broadcast_to(second_half[None, :, :, :], (BLOCK_M, BLOCK_N, GROUP_STEP, 4))
        zero = tl.zeros((BLOCK_M, BLOCK_N, GROUP_STEP, 4), dtype=tl.int32)
        xh1 = tl.broadcast_to(tl.load(high_ptr + x_at, mask=x_mask, other=0)[:, None, :, :], (BLOCK_M, BLOCK_N, GROUP_STEP, 4))
        xh2 = tl.broadcast_to(tl.load(high_ptr + x_at + 4, mask=x_mask, other=0)[:, None, :, :], (BLOCK_M, BLOCK_N, GROUP_STEP, 4))
        dot_first = dp4a(a1, xh1, zero, EMULATE)
        dot_second = dp4a(a2, xh2, zero, EMULATE)
        if PARTS == 2:
            xl1 = tl.broadcast_to(tl.load(low_ptr + x_at, mask=x_mask, other=0)[:, None, :, :], (BLOCK_M, BLOCK_N, GROUP_STEP, 4))
            xl2 = tl.broadcast_to(tl.load(low_ptr + x_at + 4, mask=x_mask, other=0)[:, None, :, :], (BLOCK_M, BLOCK_N, GROUP_STEP, 4))
            dot_first = dot_first * 256 + dp4a(a1, xl1, zero, EMULATE)
            dot_second = dot_second * 256 + dp4a(a2, xl2, zero, EMULATE)
        sum_first = tl.sum(dot_first, axis=3).to(tl.float32)
        sum_second = tl.sum(dot_second, axis=3).to(tl.float32)
        row_halves = rows_at[:, None] * (k // 16) + g[None, :] * 2  # [BN, GS]
        wg_mask = cols_inside[:, None] & g_inside[None, :]
        d = tl.load(d_ptr + rows_at[:, None] * (k // 256) + g[None, :] // 8, mask=wg_mask, other=0.0).to(
            tl.float32)
        first_scale = d * tl.load(sub_ptr + row_halves, mask=wg_mask, other=0).to(tl.int8).to(tl.float32)
        second_scale = d * tl.load(sub_ptr + row_halves + 1, mask=wg_mask, other=0).to(tl.int8).to(tl.float32)
        xg = m[:, None] * groups + g[None, :]  # [BM, GS]
        xg_mask = m_inside[:, None] & g_inside[None, :]
        dx = tl.load(scale_ptr + xg, mask=xg_mask, other=0.0)[:, None, :]
        sx_first = tl.load(half_total_ptr + xg * 2, mask=xg_mask, other=0.0)[:, None, :]
        sx_second = tl.load(half_total_ptr + xg * 2 + 1, mask=xg_mask, other=0.0)[:, None, :]
        acc += first_scale[None, :, :] * (dx * sum_first - 32.0 * sx_first)
        acc += second_scale[None, :, :] * (dx * sum_second - 32.0 * sx_second)
    out = tl.sum(acc, axis=2)
    tl.store(
        out_ptr + m[:, None] * out_stride + cols[None, :], out.to(out_ptr.dtype.element_ty),
        mask=m_inside[:, None] & cols_inside[None, :],
    )
