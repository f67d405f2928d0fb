"""Attention of a padded batch (`dflash.batch.padded`) read in place from the paged K/V pool (flash decoding).

The padded step gives every request `rows` query rows and `keys` key positions, whose pool slots are `read_slots`
[requests, keys]. Gathering those keys and values into a [requests, kv_heads, keys, head_dim] copy before SDPA costs
a fifth of a small model's step on an H100. Here the pool is read through the slots (indirect loads), as
`dflash.kernels.triton_attention.few_row_attention` reads a static cache:

1. one program per (key/value head, request and block of its query rows, slice of the keys): the block holds every
   query head of the group times every query row (``m = g * rows + r``), so each key/value row is read once per
   group; scores (fp32), an online softmax and the weighted values over the slice, written as partial
   (max, sum, accumulator), or as the output itself where the keys fit one slice;
2. one program per (key/value head, request and `COMBINE_M` rows of a block): the partials combined.

Visibility is derived in the program from what the batch loads (`PaddedBatch`: committed lengths, row counts and
the visibility among the new rows), so no [requests, rows, keys] mask is read: a row sees every committed key, the
new rows its visibility allows, and key 0 (so that a padding row reads one finite slot, as with the batch's mask).
A program stops at its request's last key (committed plus new rows): the keys bucket past it costs nothing. The
launch sizes depend on the shapes alone, so the launches can be captured in a CUDA graph.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import torch

from dflash import environment
from dflash.kernels.triton_attention import attention_kernel_usable
from dflash.kernels.triton_decode import interpreting, next_power_of_two, triton_available

BLOCK_N = 64  # keys per step inside a slice
# about four programs per SM on an H100: a program's key loop waits on dependent loads (slots, then keys), which
# only other resident programs hide (results/gpu_concurrency_h100.json, `paged_attention_programs`)
TARGET_PROGRAMS = 528
MIN_SLICE = 128  # keys per program at least (longer slices: fewer partials to write and combine)
COMBINE_M = 16  # query rows per combining program


@cache
def _kernels() -> tuple[Any, Any]:
    import triton
    import triton.language as tl

    @triton.jit
    def paged_slice_kernel(  # type: ignore[no-untyped-def]
        q_ptr, k_ptr, v_ptr, read_ptr, past_ptr, counts_ptr, visibility_ptr, part_acc_ptr, part_max_ptr,
        part_sum_ptr, out_ptr,
        rows, group, keys, m_blocks, slices, kv_head_stride, q_request_stride, q_head_stride, q_row_stride,
        out_request_stride, out_head_stride, out_row_stride, scale,
        SLICE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr,
        IEEE: tl.constexpr, DIRECT: tl.constexpr,
    ):
        kv_head = tl.program_id(0)
        request = (tl.program_id(1) // m_blocks).to(tl.int64)
        m_block = tl.program_id(1) % m_blocks
        part = tl.program_id(2)
        m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
        live_m = m < group * rows
        row = m % rows
        head = kv_head * group + m // rows
        dims = tl.arange(0, HEAD_DIM)
        q = tl.load(q_ptr + request * q_request_stride + row[:, None] * q_row_stride + head[:, None] * q_head_stride
                    + dims[None, :], mask=live_m[:, None], other=0.0)  # [BLOCK_M, HEAD_DIM]
        past = tl.load(past_ptr + request)  # committed keys: every row sees them
        count = tl.load(counts_ptr + request)  # new rows, at keys past .. past + count - 1
        end = tl.minimum(tl.maximum(past + count, 1), keys).to(tl.int32)  # key 0 is read even by padding
        running_max = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
        running_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        base = kv_head.to(tl.int64) * kv_head_stride
        start = part * SLICE
        stop = tl.minimum(start + SLICE, end)
        for offset in range(start, stop, BLOCK_N):  # nothing where the slice starts past the request's keys
            keys_at = offset + tl.arange(0, BLOCK_N)
            live_n = keys_at < stop
            slots = tl.load(read_ptr + request * keys + keys_at, mask=live_n, other=0)  # [BLOCK_N] int64
            # masked keys load zeros: a pool slot past the request's keys may never have been written
            k = tl.load(k_ptr + base + slots[:, None] * HEAD_DIM + dims[None, :], mask=live_n[:, None], other=0.0)
            if IEEE:  # noqa: SIM108 (constexpr branches: tf32 products only for 16-bit inputs)
                scores = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                scores = tl.dot(q, tl.trans(k))
            relative = keys_at - past  # [BLOCK_N]: the key's new row, negative for committed keys
            new = (relative >= 0) & (relative < count)
            among = tl.load(visibility_ptr + (request * rows + row[:, None]) * rows + relative[None, :],
                            mask=live_m[:, None] & new[None, :], other=0)  # [BLOCK_M, BLOCK_N]
            seen = (relative < 0) | (keys_at == 0)  # committed keys, and key 0
            visible = (seen[None, :] | (among != 0)) & live_n[None, :]
            scores = tl.where(visible, scores * scale, -float("inf"))  # [BLOCK_M, BLOCK_N]
            new_max = tl.maximum(running_max, tl.max(scores, axis=1))
            alpha = tl.exp(running_max - new_max)
            weights = tl.exp(scores - new_max[:, None])
            running_sum = running_sum * alpha + tl.sum(weights, axis=1)
            v = tl.load(v_ptr + base + slots[:, None] * HEAD_DIM + dims[None, :], mask=live_n[:, None], other=0.0)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(weights.to(v.dtype), v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(weights.to(v.dtype), v)
            running_max = new_max
        if DIRECT:  # the launch's only slice: the output itself
            out = acc / tl.where(running_sum > 0, running_sum, 1.0)[:, None]
            tl.store(out_ptr + request * out_request_stride + row[:, None] * out_row_stride
                     + head[:, None] * out_head_stride + dims[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=live_m[:, None])
            return
        slot = (kv_head * tl.num_programs(1) + tl.program_id(1)) * slices + part
        tl.store(part_acc_ptr + (slot * BLOCK_M + tl.arange(0, BLOCK_M))[:, None] * HEAD_DIM + dims[None, :], acc)
        tl.store(part_max_ptr + slot * BLOCK_M + tl.arange(0, BLOCK_M), running_max)
        tl.store(part_sum_ptr + slot * BLOCK_M + tl.arange(0, BLOCK_M), running_sum)

    @triton.jit
    def paged_combine_kernel(  # type: ignore[no-untyped-def]
        part_acc_ptr, part_max_ptr, part_sum_ptr, out_ptr, rows, group, slices, m_blocks, out_request_stride,
        out_head_stride, out_row_stride,
        BLOCK_M: tl.constexpr, COMBINE_M: tl.constexpr, SLICES: tl.constexpr, HEAD_DIM: tl.constexpr,
    ):
        kv_head = tl.program_id(0)
        split = BLOCK_M // COMBINE_M  # combining programs per block
        block = tl.program_id(1) // split  # request * m_blocks + m_block
        request = (block // m_blocks).to(tl.int64)
        local = tl.program_id(1) % split * COMBINE_M + tl.arange(0, COMBINE_M)  # rows of the block
        m = block % m_blocks * BLOCK_M + local
        live_m = m < group * rows
        dims = tl.arange(0, HEAD_DIM)
        first = (kv_head * (tl.num_programs(1) // split) + block) * slices
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
        tl.store(out_ptr + request * out_request_stride + row[:, None] * out_row_stride
                 + head[:, None] * out_head_stride + dims[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=live_m[:, None])

    return paged_slice_kernel, paged_combine_kernel


def paged_attention_usable(device: torch.device, head_dim: int) -> bool:
    """Whether the padded passes attend through `paged_attention` instead of gathering each request's keys for
    SDPA: on a CUDA device (or under Triton's interpreter), for a head_dim that is a power of two of at least 16,
    unless DFLASH_PADDED_ATTENTION=gather (read when a graph is captured)."""
    return (
        environment.padded_attention() == "paged"
        and triton_available()
        and (device.type == "cuda" or interpreting())
        and attention_kernel_usable(head_dim)
    )


def paged_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, read_slots: torch.Tensor, past: torch.Tensor,
    counts: torch.Tensor, visibility: torch.Tensor, scale: float, min_slice: int = MIN_SLICE,
) -> torch.Tensor:
    """Masked attention of a padded batch over one layer of the pool.

    q: [requests, heads, rows, head_dim] (unit stride along head_dim); keys, values: [kv_heads, slots, head_dim]
    (one layer of the pool, unit strides within a kv head); read_slots: [requests, keys] int64 contiguous (each key
    position's slot); past: [requests] int64 (committed keys); counts: [requests] int64 (real rows, 0 for a padding
    request); visibility: [requests, rows, rows] bool contiguous (which new rows each row sees). Row i of request b
    sees key j < past[b], key past[b] + t for t < counts[b] where visibility[b, i, t], and key 0; keys at or past
    past[b] + counts[b] are never read. -> [requests, heads, rows, head_dim] in q's dtype, a view of a contiguous
    [requests, rows, heads, head_dim] tensor (`out.transpose(1, 2).reshape(requests, rows, -1)` copies nothing).
    `min_slice`: keys per program at least (a power of two, at least `BLOCK_N`)."""
    requests, heads, rows, head_dim = q.shape
    kv_heads = keys.shape[0]
    if q.stride(3) != 1:
        raise ValueError("paged_attention needs q with unit stride along head_dim")
    for pool in (keys, values):  # the programs address a slot's row as slot * head_dim within a kv head
        if pool.stride(1) != head_dim or pool.stride(2) != 1 or pool.stride(0) != keys.stride(0):
            raise ValueError("paged_attention needs keys and values laid out [kv_heads, slots, head_dim] alike")
    key_count = read_slots.shape[1]
    group = heads // kv_heads
    block_m = min(64, max(16, next_power_of_two(group * rows)))
    m_blocks = -(-group * rows // block_m)
    wanted = max(1, TARGET_PROGRAMS // (kv_heads * requests * m_blocks))
    slice_len = max(min_slice, BLOCK_N, next_power_of_two(-(-key_count // wanted)))
    slices = -(-key_count // slice_len)
    direct = slices == 1
    device = q.device
    partials = 1 if direct else kv_heads * requests * m_blocks * slices * block_m  # one: an unused placeholder
    part_acc = torch.empty((partials, head_dim), dtype=torch.float32, device=device)
    part_max = torch.empty(partials, dtype=torch.float32, device=device)
    part_sum = torch.empty_like(part_max)
    out = torch.empty((requests, rows, heads, head_dim), dtype=q.dtype, device=device)
    slice_kernel, combine = _kernels()
    slice_kernel[(kv_heads, requests * m_blocks, slices)](
        q, keys, values, read_slots, past, counts, visibility.view(torch.uint8), part_acc, part_max, part_sum, out,
        rows, group, key_count, m_blocks, slices, keys.stride(0), q.stride(0), q.stride(1), q.stride(2),
        out.stride(0), out.stride(2), out.stride(1), scale,
        SLICE=slice_len, BLOCK_N=BLOCK_N, BLOCK_M=block_m, HEAD_DIM=head_dim, IEEE=q.dtype == torch.float32,
        DIRECT=direct, num_warps=4,
    )
    if not direct:
        combine_m = min(block_m, COMBINE_M)
        combine[(kv_heads, requests * m_blocks * (block_m // combine_m))](
            part_acc, part_max, part_sum, out, rows, group, slices, m_blocks, out.stride(0), out.stride(2),
            out.stride(1), BLOCK_M=block_m, COMBINE_M=combine_m, SLICES=next_power_of_two(slices), HEAD_DIM=head_dim,
            num_warps=4,
        )
    return out.transpose(1, 2)
