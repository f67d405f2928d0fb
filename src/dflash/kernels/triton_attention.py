"""Attention of a few query rows over a long static cache, split over the keys (flash decoding), for GQA.

A decoding step, a verification and a tree verification attend with 1 to ~64 query rows over the whole cached
context under a mask. torch's SDPA handles GQA and a mask for such shapes with little parallelism or with the key
/value heads expanded, so at long contexts a 16-row verification costs several one-row steps. Here:

1. one program per (key/value head, block of query rows, slice of the keys): the block holds every query head of
   the group times every query row (``m = g * rows + r``), so each key/value row is read once per group; scores
   (fp32, plus the additive mask), an online softmax and the weighted values over the slice, written as partial
   (max, sum, accumulator);
2. one program per (key/value head, `COMBINE_M` rows of a block): the partials combined. A launch whose keys fit
   one slice skips this step: its programs normalise and write their output directly (one launch per layer instead
   of two, about 1.6 us less per layer at the default model's size; `benchmarks/gpu_round_profile.py`).
   Combining inside the first launch instead (the last program of a block to finish reading the others' partials)
   measured slower than the second launch at every size tried (`results/gpu_attention_combine_h100.json`).

Masked-out entries are ``-inf`` in the additive mask; a slice a row cannot see leaves a zero partial.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import torch

from dflash.kernels.triton_decode import next_power_of_two

BLOCK_N = 64  # keys per step inside a slice
TARGET_PROGRAMS = 132  # about one program per SM on an H100 (measured best of 132 and 264)
MIN_SLICE = 256  # keys per program at least (longer slices: fewer partials to write and combine)
COMBINE_M = 16  # query rows per combining program (a block's rows are combined by several programs in parallel)


@cache
def _kernels() -> tuple[Any, Any]:
    import triton
    import triton.language as tl

    @triton.jit
    def slice_attention_kernel(  # type: ignore[no-untyped-def]
        q_ptr, k_ptr, v_ptr, mask_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, out_ptr,
        rows, group, capacity, bucket, mask_row_stride, q_row_stride, q_head_stride, out_row_stride,
        out_head_stride, scale, slices,
        SLICE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr,
        IEEE: tl.constexpr, DIRECT: tl.constexpr,
    ):
        kv_head = tl.program_id(0)
        m_block = tl.program_id(1)
        part = tl.program_id(2)
        m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
        live_m = m < group * rows
        row = m % rows
        head = kv_head * group + m // rows
        dims = tl.arange(0, HEAD_DIM)
        q = tl.load(q_ptr + row[:, None] * q_row_stride + head[:, None] * q_head_stride + dims[None, :],
                    mask=live_m[:, None], other=0.0)  # [BLOCK_M, HEAD_DIM]
        running_max = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
        running_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        base = kv_head.to(tl.int64) * capacity * HEAD_DIM
        start = part * SLICE
        for offset in range(0, SLICE, BLOCK_N):
            keys_at = start + offset + tl.arange(0, BLOCK_N)
            live_n = keys_at < bucket
            k = tl.load(k_ptr + base + keys_at[:, None] * HEAD_DIM + dims[None, :], mask=live_n[:, None], other=0.0)
            if IEEE:  # noqa: SIM108 (constexpr branches: tf32 products only for 16-bit inputs)
                scores = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                scores = tl.dot(q, tl.trans(k))
            additive = tl.load(mask_ptr + row[:, None] * mask_row_stride + keys_at[None, :],
                               mask=live_m[:, None] & live_n[None, :], other=-float("inf")).to(tl.float32)
            scores = scores * scale + additive  # [BLOCK_M, BLOCK_N]
            new_max = tl.maximum(running_max, tl.max(scores, axis=1))
            alpha = tl.exp(running_max - new_max)
            weights = tl.exp(scores - new_max[:, None])
            running_sum = running_sum * alpha + tl.sum(weights, axis=1)
            v = tl.load(v_ptr + base + keys_at[:, None] * HEAD_DIM + dims[None, :], mask=live_n[:, None], other=0.0)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(weights.to(v.dtype), v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(weights.to(v.dtype), v)
            running_max = new_max
        if DIRECT:  # the launch's only slice: the output itself
            out = acc / tl.where(running_sum > 0, running_sum, 1.0)[:, None]
            tl.store(out_ptr + row[:, None] * out_row_stride + head[:, None] * out_head_stride + dims[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=live_m[:, None])
            return
        slot = (kv_head * tl.num_programs(1) + m_block) * slices + part
        tl.store(part_acc_ptr + (slot * BLOCK_M + tl.arange(0, BLOCK_M))[:, None] * HEAD_DIM + dims[None, :], acc)
        tl.store(part_max_ptr + slot * BLOCK_M + tl.arange(0, BLOCK_M), running_max)
        tl.store(part_sum_ptr + slot * BLOCK_M + tl.arange(0, BLOCK_M), running_sum)

    @triton.jit
    def combine_kernel(  # type: ignore[no-untyped-def]
        part_acc_ptr, part_max_ptr, part_sum_ptr, out_ptr, rows, group, slices, m_blocks, out_row_stride,
        out_head_stride, BLOCK_M: tl.constexpr, COMBINE_M: tl.constexpr, SLICES: tl.constexpr,
        HEAD_DIM: tl.constexpr,
    ):
        kv_head = tl.program_id(0)
        m_block = tl.program_id(1) // (BLOCK_M // COMBINE_M)
        local = tl.program_id(1) % (BLOCK_M // COMBINE_M) * COMBINE_M + tl.arange(0, COMBINE_M)  # rows of the block
        m = m_block * BLOCK_M + local
        live_m = m < group * rows
        dims = tl.arange(0, HEAD_DIM)
        first = (kv_head * m_blocks + m_block) * slices
        parts = tl.arange(0, SLICES)  # SLICES: a power of two >= slices
        live_parts = parts < slices
        top = tl.max(tl.load(part_max_ptr + (first + parts)[:, None] * BLOCK_M + local[None, :],
                             mask=live_parts[:, None], other=-1.0e30), axis=0)  # [COMBINE_M]
        total = tl.zeros([COMBINE_M], dtype=tl.float32)
        acc = tl.zeros([COMBINE_M, HEAD_DIM], dtype=tl.float32)
        for part in tl.static_range(SLICES):  # unrolled: the loads do not wait for each other
            live = local * 0 + part < slices  # [COMBINE_M] (every row alike)
            slot = first + part
            weight = tl.exp(tl.load(part_max_ptr + slot * BLOCK_M + local, mask=live, other=-float("inf")) - top)
            total += weight * tl.load(part_sum_ptr + slot * BLOCK_M + local, mask=live, other=0.0)
            acc += weight[:, None] * tl.load(part_acc_ptr + (slot * BLOCK_M + local)[:, None] * HEAD_DIM + dims[None, :],
                                             mask=live[:, None], other=0.0)
        out = acc / tl.where(total > 0, total, 1.0)[:, None]
        row = m % rows
        head = kv_head * group + m // rows
        tl.store(out_ptr + row[:, None] * out_row_stride + head[:, None] * out_head_stride + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=live_m[:, None])

    return slice_attention_kernel, combine_kernel


def attention_kernel_usable(head_dim: int) -> bool:
    return head_dim == next_power_of_two(head_dim) and head_dim >= 16


def few_row_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, additive_mask: torch.Tensor, bucket: int, scale: float,
    min_slice: int = MIN_SLICE,
) -> torch.Tensor:
    """q: [rows, heads, head_dim] (unit stride along head_dim); keys, values: [kv_heads, capacity, head_dim]
    contiguous (one layer of the static cache); additive_mask: [rows, >= bucket] (0 or -inf, unit stride along the
    keys); attends over keys [0, bucket) -> [rows, heads, head_dim] in q's dtype. `min_slice`: keys per program at
    least (a power of two, at least `BLOCK_N`)."""
    rows, heads, head_dim = q.shape
    kv_heads, capacity, _ = keys.shape
    group = heads // kv_heads
    block_m = min(64, max(16, next_power_of_two(group * rows)))
    m_blocks = -(-group * rows // block_m)
    wanted = max(1, TARGET_PROGRAMS // (kv_heads * m_blocks))
    slice_len = max(min_slice, BLOCK_N, next_power_of_two(-(-bucket // wanted)))
    slices = -(-bucket // slice_len)
    direct = slices == 1
    device = q.device
    partials = 1 if direct else kv_heads * m_blocks * slices * block_m  # one: an unused placeholder
    part_acc = torch.empty((partials, head_dim), dtype=torch.float32, device=device)
    part_max = torch.empty(partials, dtype=torch.float32, device=device)
    part_sum = torch.empty_like(part_max)
    out = torch.empty((rows, heads, head_dim), dtype=q.dtype, device=device)
    slice_kernel, combine = _kernels()
    slice_kernel[(kv_heads, m_blocks, slices)](
        q, keys, values, additive_mask, part_acc, part_max, part_sum, out,
        rows, group, capacity, bucket, additive_mask.stride(0), q.stride(0), q.stride(1), out.stride(0),
        out.stride(1), scale, slices,
        SLICE=slice_len, BLOCK_N=BLOCK_N, BLOCK_M=block_m, HEAD_DIM=head_dim, IEEE=q.dtype == torch.float32,
        DIRECT=direct, num_warps=4,
    )
    if not direct:
        combine_m = min(block_m, COMBINE_M)
        combine[(kv_heads, m_blocks * (block_m // combine_m))](
            part_acc, part_max, part_sum, out, rows, group, slices, m_blocks, out.stride(0), out.stride(1),
            BLOCK_M=block_m, COMBINE_M=combine_m, SLICES=next_power_of_two(slices), HEAD_DIM=head_dim, num_warps=4,
        )
    return out
