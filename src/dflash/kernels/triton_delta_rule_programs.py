"""The Triton program of `dflash.kernels.triton_delta_rule` (imported only where Triton is installed)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def delta_step(  # type: ignore[no-untyped-def]
    state, k_ptr, v_ptr, g_ptr, beta_ptr, row, keys, values, key_in, value_in, k_row, v_row
):
    """One row's forget and delta write on a [BK, BV] tile."""
    k = tl.load(k_ptr + row * k_row + keys, mask=key_in, other=0.0)
    v = tl.load(v_ptr + row * v_row + values, mask=value_in, other=0.0)
    decay = tl.exp(tl.load(g_ptr + row))
    beta = tl.load(beta_ptr + row)
    state = state * decay
    predicted = tl.sum(state * k[:, None], axis=0)  # [BV]
    write = (v - predicted) * beta
    return state + k[:, None] * write[None, :]


@triton.jit
def delta_rows_kernel(  # type: ignore[no-untyped-def]
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, ancestors_ptr, count_ptr, out_ptr, final_ptr,
    rows, heads, group, key_dim, value_dim,
    q_seq, q_head, q_row, k_seq, k_head, k_row, v_seq, v_head, v_row, gb_seq, gb_head, gb_row,
    o_seq, o_head, o_row,
    READ: tl.constexpr, TREE: tl.constexpr, FINAL: tl.constexpr, COUNTED: tl.constexpr, BK: tl.constexpr,
    BV: tl.constexpr,
):
    """Grid (sequences * heads, value blocks); q and k hold heads // group heads (each serving `group`
    consecutive value heads). A tree's ancestors are [rows, rows] int8 (`rows` the row stride);
    COUNTED: a chain's live rows are read from count_ptr (a padded graph's real rows), `rows` is the bound."""
    sequence_head = tl.program_id(0)
    sequence = (sequence_head // heads).to(tl.int64)
    head = (sequence_head % heads).to(tl.int64)
    keys = tl.arange(0, BK)
    values = tl.program_id(1) * BV + tl.arange(0, BV)
    key_in = keys < key_dim
    value_in = values < value_dim
    tile = keys[:, None] * value_dim + values[None, :]
    tile_in = key_in[:, None] & value_in[None, :]
    state_at = (sequence * heads + head) * key_dim * value_dim
    start = tl.load(state_ptr + state_at + tile, mask=tile_in, other=0.0)
    key_head = head // group
    k_base = k_ptr + sequence * k_seq + key_head * k_head
    v_base = v_ptr + sequence * v_seq + head * v_head
    g_base = g_ptr + sequence * gb_seq + head * gb_head
    beta_base = beta_ptr + sequence * gb_seq + head * gb_head
    state = start
    live = rows
    if COUNTED:
        live = tl.load(count_ptr).to(tl.int32)
    for t in range(live):
        if TREE:
            follows = t > 0
            if follows:
                follows = tl.load(ancestors_ptr + t * rows + t - 1) != 0  # the previous row is the parent
            if follows:
                state = delta_step(state, k_base, v_base, g_base, beta_base, t, keys, values, key_in, value_in,
                             k_row, v_row)
            else:
                state = start
                for j in range(t + 1):
                    if tl.load(ancestors_ptr + t * rows + j) != 0:
                        state = delta_step(state, k_base, v_base, g_base, beta_base, j, keys, values, key_in,
                                     value_in, k_row, v_row)
        else:
            state = delta_step(state, k_base, v_base, g_base, beta_base, t, keys, values, key_in, value_in,
                         k_row, v_row)
        if READ:
            q = tl.load(q_ptr + sequence * q_seq + key_head * q_head + t * q_row + keys, mask=key_in, other=0.0)
            out = tl.sum(state * q[:, None], axis=0)
            tl.store(out_ptr + sequence * o_seq + head * o_head + t * o_row + values, out, mask=value_in)
    if FINAL:
        tl.store(final_ptr + state_at + tile, state, mask=tile_in)
