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
from types import ModuleType

import torch

from dflash.kernels.triton_decode import next_power_of_two

REGIONS = 2


@cache
def _programs() -> ModuleType:
    from dflash.kernels import triton_rank_sums_programs

    return triton_rank_sums_programs




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

    _programs().oneway_sum_add_rms_norm_kernel[(rows,)](
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
    _programs().sum_add_rms_norm_kernel[(rows,)](
        partial, residual if residual is not None else partial, weight, out, summed, buffers, pads,
        rank, width, capacity, region_offset, first_flag, eps,
        WORLD=world, HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=8 if block >= 4096 else 4,
    )
    return out, summed
