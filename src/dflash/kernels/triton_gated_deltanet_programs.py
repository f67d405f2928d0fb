"""The Triton programs of `dflash.kernels.triton_gated_deltanet` (imported only where Triton is installed)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def gdn_inputs_kernel(  # type: ignore[no-untyped-def]
    proj_ptr, window_ptr, conv_ptr, taps_ptr, a_log_ptr, dt_bias_ptr,
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, conv_out_ptr, window_out_ptr, count_ptr,
    rows, proj_stride, channels, key_heads, value_heads, z_size, scale,
    k_head_stride, v_head_stride, gb_head_stride, conv_out_stride,
    KERNEL: tl.constexpr, KEY_DIM: tl.constexpr, VALUE_DIM: tl.constexpr, BD: tl.constexpr,
    KEEP_CONV: tl.constexpr, WINDOW: tl.constexpr, COUNTED: tl.constexpr,
):
    """Grid (rows, 2 * key_heads + value_heads): one head's channels of one row (q heads, then k, then v),
    convolved over the row's taps (indices into the window's rows then the new rows), SiLU; q and k heads
    L2-normalised (q times `scale`), stored heads first in float32 (q [heads, rows, dim] contiguous; k, v, g, beta
    with the given head strides, rows contiguous). A v head's program also finds that head's decay g = -exp(A_log)
    softplus(a + dt_bias) and write strength beta = sigmoid(b) for the row. KEEP_CONV: each row's own convolution
    inputs copied to conv_out; WINDOW: the row-0 programs write the window after the live rows (count_ptr's, or
    all) to window_out [KERNEL - 1, channels]."""
    row = tl.program_id(0)
    unit = tl.program_id(1)
    key_size = key_heads * KEY_DIM
    is_value = unit >= 2 * key_heads
    value_head = unit - 2 * key_heads
    first = tl.where(is_value, 2 * key_size + value_head * VALUE_DIM, unit * KEY_DIM)
    width = tl.where(is_value, VALUE_DIM, KEY_DIM)
    lanes = tl.arange(0, BD)
    inside = lanes < width
    columns = first + lanes
    acc = tl.zeros((BD,), dtype=tl.float32)
    for j in tl.static_range(KERNEL):
        tap = tl.load(taps_ptr + row * KERNEL + j)
        from_window = tap < KERNEL - 1
        source = tl.where(
            from_window, window_ptr + tap * channels + columns, proj_ptr + (tap - (KERNEL - 1)) * proj_stride + columns
        )
        raw = tl.load(source, mask=inside, other=0.0)
        if KEEP_CONV and j == KERNEL - 1:  # the newest tap is the row itself
            tl.store(conv_out_ptr + row * conv_out_stride + columns, raw, mask=inside)
        acc += raw.to(tl.float32) * tl.load(conv_ptr + columns * KERNEL + j, mask=inside, other=0.0).to(tl.float32)
    if WINDOW:  # noqa: SIM102 (a compile-time switch around a run-time test)
        if row == 0:
            live = rows
            if COUNTED:
                live = tl.load(count_ptr).to(tl.int32)
            for j in tl.static_range(KERNEL - 1):
                index = live + j  # into (window rows, then new rows)
                source = tl.where(
                    index < KERNEL - 1, window_ptr + index * channels + columns,
                    proj_ptr + (index - (KERNEL - 1)) * proj_stride + columns,
                )
                tl.store(window_out_ptr + j * channels + columns, tl.load(source, mask=inside, other=0.0), mask=inside)
    y = acc * tl.sigmoid(acc)
    if is_value:
        tl.store(v_ptr + value_head * v_head_stride + row * VALUE_DIM + lanes, y, mask=inside)
        b = tl.load(proj_ptr + row * proj_stride + channels + z_size + value_head).to(tl.float32)
        a = tl.load(proj_ptr + row * proj_stride + channels + z_size + value_heads + value_head).to(tl.float32)
        shifted = a + tl.load(dt_bias_ptr + value_head).to(tl.float32)
        softplus = tl.where(shifted > 20.0, shifted, tl.log(1.0 + tl.exp(tl.minimum(shifted, 20.0))))
        decay = -tl.exp(tl.load(a_log_ptr + value_head).to(tl.float32)) * softplus
        tl.store(g_ptr + value_head * gb_head_stride + row, decay)
        tl.store(beta_ptr + value_head * gb_head_stride + row, tl.sigmoid(b))
    else:
        normed = y / tl.sqrt(tl.sum(y * y, axis=0) + 1e-6)
        if unit < key_heads:
            tl.store(q_ptr + (unit * rows + row) * KEY_DIM + lanes, normed * scale, mask=inside)
        else:
            tl.store(k_ptr + (unit - key_heads) * k_head_stride + row * KEY_DIM + lanes, normed, mask=inside)


@triton.jit
def gated_norm_kernel(  # type: ignore[no-untyped-def]
    o_ptr, proj_ptr, weight_ptr, out_ptr, rows, proj_stride, z_offset, eps,
    VALUE_DIM: tl.constexpr, BV: tl.constexpr,
):
    """Grid (rows, value heads): a head's read-out o [heads, rows, VALUE_DIM] (float32) RMS-normalised, times the
    norm's weight and SiLU(z) (z: that head's slice of the row's projection) -> out [rows, heads * VALUE_DIM]."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    lanes = tl.arange(0, BV)
    inside = lanes < VALUE_DIM
    o = tl.load(o_ptr + (head * rows + row) * VALUE_DIM + lanes, mask=inside, other=0.0)
    normed = o / tl.sqrt(tl.sum(o * o, axis=0) / VALUE_DIM + eps)
    z = tl.load(proj_ptr + row * proj_stride + z_offset + head * VALUE_DIM + lanes, mask=inside, other=0.0)
    z = z.to(tl.float32)
    weight = tl.load(weight_ptr + lanes, mask=inside, other=0.0).to(tl.float32)
    heads = tl.num_programs(1)
    out = weight * normed * (z * tl.sigmoid(z))
    tl.store(out_ptr + row * heads * VALUE_DIM + head * VALUE_DIM + lanes, out.to(out_ptr.dtype.element_ty), mask=inside)
