"""The Triton programs of `dflash.kernels.triton_rank_sums` (imported only where Triton is installed)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def add_and_norm(  # type: ignore[no-untyped-def]
    x, residual_ptr, weight_ptr, out_ptr, sum_ptr, row, cols, inside, width, eps, HAS_RESIDUAL: tl.constexpr
):
    """Row `row`'s sum x (the model's dtype) plus its residual, stored, then RMSNorm(x) * weight stored: exactly
    `triton_decode.add_rms_norm`'s arithmetic."""
    dtype = x.dtype
    if HAS_RESIDUAL:
        added = x.to(tl.float32) + tl.load(residual_ptr + row * width + cols, mask=inside, other=0.0).to(tl.float32)
        x = added.to(dtype)
    tl.store(sum_ptr + row * width + cols, x, mask=inside)
    x32 = x.to(tl.float32)
    inverse_rms = 1.0 / tl.sqrt(tl.sum(x32 * x32, axis=0) / width + eps)
    normed = (x32 * inverse_rms).to(dtype).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * width + cols, (normed * weight).to(out_ptr.dtype.element_ty), mask=inside)


@triton.jit
def sum_add_rms_norm_kernel(  # type: ignore[no-untyped-def]
    partial_ptr, residual_ptr, weight_ptr, out_ptr, sum_ptr, buffers_ptr, pads_ptr,
    rank, width, capacity, region_offset, first_flag, eps,
    WORLD: tl.constexpr, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    inside = cols < width
    dtype = partial_ptr.dtype.element_ty
    mine = tl.load(partial_ptr + row * width + cols, mask=inside, other=0.0)
    for peer in tl.static_range(WORLD):
        if peer != rank:  # this rank's slot in the peer's region: [sender][capacity rows][width]
            peer_buffer = tl.load(buffers_ptr + peer).to(tl.pointer_type(dtype))
            tl.store(peer_buffer + region_offset + (rank * capacity + row) * width + cols, mine, mask=inside)
    tl.debug_barrier()  # every thread's stores are issued before the flag goes up
    flags = first_flag + row * WORLD  # this row's flags in a pad: one per sending rank
    for peer in tl.static_range(WORLD):
        if peer != rank:
            peer_pad = tl.load(pads_ptr + peer).to(tl.pointer_type(tl.int32))
            tl.atomic_xchg(peer_pad + flags + rank, 1, sem="release", scope="sys")
    own_pad = tl.load(pads_ptr + rank).to(tl.pointer_type(tl.int32))
    for peer in tl.static_range(WORLD):
        if peer != rank:
            while tl.atomic_cas(own_pad + flags + peer, 1, 0, sem="acquire", scope="sys") != 1:
                pass
    tl.debug_barrier()  # no thread reads a peer's row before its flag was seen
    own_buffer = tl.load(buffers_ptr + rank).to(tl.pointer_type(dtype))
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for peer in tl.static_range(WORLD):
        if peer == rank:
            total += mine.to(tl.float32)
        else:
            sent = own_buffer + region_offset + (peer * capacity + row) * width + cols
            total += tl.load(sent, mask=inside, other=0.0, volatile=True).to(tl.float32)
    add_and_norm(total.to(dtype), residual_ptr, weight_ptr, out_ptr, sum_ptr, row, cols, inside, width, eps,
                 HAS_RESIDUAL)


@triton.jit
def oneway_sum_add_rms_norm_kernel(  # type: ignore[no-untyped-def]
    partial_ptr, residual_ptr, weight_ptr, out_ptr, sum_ptr, buffers_ptr,
    rank, width, capacity, region_offset, eps,
    WORLD: tl.constexpr, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, BITS: tl.constexpr,
    SIGN: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    inside = cols < width
    dtype = partial_ptr.dtype.element_ty
    mine = tl.load(partial_ptr + row * width + cols, mask=inside, other=0.0)
    # what goes out never has the "not yet written" pattern (all bits set, a NaN): that NaN is sent as the
    # NaN with the sign bit clear
    mine_bits = mine.to(BITS, bitcast=True)
    sent = tl.where(mine_bits == -1, mine_bits ^ SIGN, mine_bits).to(dtype, bitcast=True)
    for peer in tl.static_range(WORLD):
        if peer != rank:  # this rank's slot in the peer's region: [sender][capacity rows][width]
            peer_buffer = tl.load(buffers_ptr + peer).to(tl.pointer_type(dtype))
            tl.store(peer_buffer + region_offset + (rank * capacity + row) * width + cols, sent, mask=inside)
    own_buffer = tl.load(buffers_ptr + rank).to(tl.pointer_type(dtype))
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for peer in tl.static_range(WORLD):
        if peer == rank:
            total += mine.to(tl.float32)
        else:
            slot = own_buffer + region_offset + (peer * capacity + row) * width + cols
            arrived = tl.load(slot, mask=inside, other=0.0, volatile=True)
            while tl.max((arrived.to(BITS, bitcast=True) == -1).to(tl.int32), axis=0) != 0:
                arrived = tl.load(slot, mask=inside, other=0.0, volatile=True)
            total += arrived.to(tl.float32)
            tl.store(slot.to(tl.pointer_type(BITS)), tl.full((BLOCK,), -1, BITS), mask=inside)  # unwritten again
    add_and_norm(total.to(dtype), residual_ptr, weight_ptr, out_ptr, sum_ptr, row, cols, inside, width, eps,
                 HAS_RESIDUAL)
