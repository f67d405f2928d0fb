"""The tensor-parallel sum folded into the add+RMSNorm that follows it (GPU ranks with symmetric memory).

Every row-parallel projection (attention output, MLP down) ends in a sum over the ranks, and the fused forward's
next step is always an add+RMSNorm of that sum into the residual stream. Done apart, that is two launches: the
one-shot all-reduce (copy the partial into this rank's symmetric buffer, meet the peers, add every buffer) and the
add+RMSNorm. `sum_add_rms_norm` does both in one program per row:

1. store this rank's partial row into every peer's buffer, in the slot this rank owns there (the writes go out over
   NVLink without waiting for an answer);
2. raise this rank's flag in each peer's signal pad (release semantics at system scope: the row's stores are
   visible before the flag), then wait for each peer's flag in this rank's own pad and lower it (acquire);
3. add every rank's row in rank order, the peers' from this rank's own memory (float32, rounded to the model's
   dtype once: what the one-shot all-reduce gives), then the residual and the RMSNorm exactly as
   `triton_decode.add_rms_norm` does.

Pushing the rows to the readers puts one one-way trip over NVLink on the critical path, where the one-shot
all-reduce's pull (flag handshake, then remote loads) has round trips. Every rank adds the same rows in the same
order, so every rank gets the same bits, as with NCCL's all-reduce. The flags are ours (the top of the pad:
PyTorch's kernels use its start).

Consecutive sums alternate between two regions (buffer slots and flags; the caller passes `region`: the forward
uses one for attention outputs, one for MLP outputs). That makes the plain stores safe: this rank writes a peer's
region r (and raises its flag there) in sum n only after the peer's flag of sum n - 1, which the peer raised after
its program of sum n - 2 (which read region r and lowered that flag) had ended, kernels on a stream running in order.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import torch

from dflash.kernels.triton_decode import next_power_of_two

REGIONS = 2


@cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

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
        x = total.to(dtype)
        if HAS_RESIDUAL:
            added = x.to(tl.float32) + tl.load(residual_ptr + row * width + cols, mask=inside, other=0.0).to(tl.float32)
            x = added.to(dtype)
        tl.store(sum_ptr + row * width + cols, x, mask=inside)
        x32 = x.to(tl.float32)
        inverse_rms = 1.0 / tl.sqrt(tl.sum(x32 * x32, axis=0) / width + eps)
        normed = (x32 * inverse_rms).to(dtype).to(tl.float32)
        weight = tl.load(weight_ptr + cols, mask=inside, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * width + cols, (normed * weight).to(out_ptr.dtype.element_ty), mask=inside)

    return sum_add_rms_norm_kernel


@cache
def _oneway_kernel() -> Any:
    import triton
    import triton.language as tl

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
        x = total.to(dtype)
        if HAS_RESIDUAL:
            added = x.to(tl.float32) + tl.load(residual_ptr + row * width + cols, mask=inside, other=0.0).to(tl.float32)
            x = added.to(dtype)
        tl.store(sum_ptr + row * width + cols, x, mask=inside)
        x32 = x.to(tl.float32)
        inverse_rms = 1.0 / tl.sqrt(tl.sum(x32 * x32, axis=0) / width + eps)
        normed = (x32 * inverse_rms).to(dtype).to(tl.float32)
        weight = tl.load(weight_ptr + cols, mask=inside, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * width + cols, (normed * weight).to(out_ptr.dtype.element_ty), mask=inside)

    return oneway_sum_add_rms_norm_kernel


def oneway_sum_add_rms_norm(
    partial: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, *,
    buffers: torch.Tensor, rank: int, world: int, capacity: int, region_offset: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sum_add_rms_norm` without flags: the rows themselves say they have arrived. The region's slots hold the
    "unwritten" pattern (every bit set) until a peer's row lands; the reader polls its slot until no element has
    that pattern, adds, and writes the pattern back. One trip over NVLink instead of data, fence, then flag. The
    regions must be filled with the pattern before the first sum (`fill_unwritten`); consecutive sums alternate
    between two regions as for `sum_add_rms_norm` (a peer writes region r again only after this rank's next sum's
    row reached it, sent after this rank wrote the pattern back)."""
    rows, width = partial.shape
    out = torch.empty_like(partial)
    summed = torch.empty_like(partial)
    block = next_power_of_two(width)
    bits = _bits_type(partial.dtype)
    import triton.language as tl

    _oneway_kernel()[(rows,)](
        partial, residual if residual is not None else partial, weight, out, summed, buffers,
        rank, width, capacity, region_offset, eps,
        WORLD=world, HAS_RESIDUAL=residual is not None, BLOCK=block, BITS=getattr(tl, bits),
        SIGN=-(2 ** (partial.element_size() * 8 - 1)), num_warps=8 if block >= 4096 else 4,
    )
    return out, summed


def _bits_type(dtype: torch.dtype) -> str:
    """The signed integer type of `dtype`'s width (Triton's name)."""
    size = torch.empty((), dtype=dtype).element_size()
    if size not in (2, 4):
        raise ValueError(f"one-way rank sums take 16- or 32-bit rows, not {dtype}")
    return f"int{size * 8}"


def fill_unwritten(regions: torch.Tensor) -> None:
    """Set every element of `regions` (this rank's one-way regions) to the "unwritten" pattern, all bits set."""
    regions.view(torch.int16 if regions.element_size() == 2 else torch.int32).fill_(-1)


def sum_add_rms_norm(
    partial: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, *,
    buffers: torch.Tensor, pads: torch.Tensor, rank: int, world: int, capacity: int, region_offset: int,
    first_flag: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """partial, residual: [rows, width] contiguous, this rank's partial rows and the residual stream ->
    (RMSNorm(sum + residual) * weight, sum + residual), sum = the partial rows summed over the ranks (without a
    residual: (RMSNorm(sum) * weight, sum)). buffers, pads: [world] int64 on this device, every rank's symmetric
    buffer and signal pad address; region_offset: where this sum's region starts in the buffers (elements), a
    region being [world senders][capacity rows][width]; first_flag: the first int32 flag of the pads this sum may
    use (rows * world of them)."""
    rows, width = partial.shape
    out = torch.empty_like(partial)
    summed = torch.empty_like(partial)
    block = next_power_of_two(width)
    _kernel()[(rows,)](
        partial, residual if residual is not None else partial, weight, out, summed, buffers, pads,
        rank, width, capacity, region_offset, first_flag, eps,
        WORLD=world, HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=8 if block >= 4096 else 4,
    )
    return out, summed
