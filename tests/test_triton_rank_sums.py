"""The rank sums folded into the add+RMSNorm (`dflash.kernels.triton_rank_sums`), one process playing both ranks.

Two GPUs run both ranks' programs at once, each waiting for the other's row (`tests/test_tensor_parallel.py`, marked
gpu). Here the peer's side is staged by hand before a rank's program runs (its row in the slot, its flag raised), so
the program never waits: that checks the arithmetic, the slots each rank writes and reads, and what each leaves
behind for the next sum, under Triton's CPU interpreter or on one GPU.
"""

from __future__ import annotations

import pytest
import torch

from dflash.kernels.triton_rank_sums import fill_unwritten, oneway_sum_add_rms_norm, sum_add_rms_norm
from dflash.kernels.triton_tree import tree_kernel_usable

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
needs_triton = pytest.mark.skipif(not tree_kernel_usable(DEVICE), reason="needs Triton (a GPU, or TRITON_INTERPRET=1)")

WORLD, CAPACITY, WIDTH, EPS = 2, 4, 1000, 1e-6  # a width that is no power of two


def rows_of(rows: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Both ranks' partial rows [rows, WIDTH], the residual [rows, WIDTH] and the norm's weight [WIDTH]."""
    generator = torch.Generator().manual_seed(seed)
    made = [torch.randn(rows, WIDTH, generator=generator) for _ in range(3)] + [torch.randn(WIDTH, generator=generator)]
    first, second, residual, weight = (t.to(DEVICE, dtype) for t in made)
    return first, second, residual, weight


def reference(first: torch.Tensor, second: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor) -> tuple[
    torch.Tensor, torch.Tensor
]:
    """The sum in rank order, then the residual and the RMSNorm, in float32 (the kernels round to the rows' dtype
    between steps: equal in float32, within a few roundings in bf16)."""
    x = first.float() + second.float() + (residual.float() if residual is not None else 0.0)
    normed = x * torch.rsqrt((x * x).mean(dim=-1, keepdim=True) + EPS) * weight.float()
    return normed, x


def assert_near(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> None:
    tolerance = 1e-5 if got[0].dtype == torch.float32 else 5e-2
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.float(), b, rtol=tolerance, atol=tolerance)


def flagged_sum(
    first: torch.Tensor, second: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank 0's result of the flagged kernel, rank 1's row and flag staged: the one-way kernel must give its bits."""
    rows = first.shape[0]
    regions = [torch.zeros(WORLD * CAPACITY * WIDTH, dtype=first.dtype, device=DEVICE) for _ in range(WORLD)]
    pads = [torch.zeros(CAPACITY * WORLD, dtype=torch.int32, device=DEVICE) for _ in range(WORLD)]
    slot(regions[0], 1, rows).copy_(second)
    pads[0].view(CAPACITY, WORLD)[:rows, 1] = 1
    return sum_add_rms_norm(
        first, residual, weight, EPS, buffers=addresses(regions), pads=addresses(pads), rank=0, world=WORLD,
        capacity=CAPACITY, region_offset=0, first_flag=0,
    )


def addresses(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64, device=DEVICE)


def slot(buffer: torch.Tensor, sender: int, rows: int) -> torch.Tensor:
    """A sender's rows in a rank's region [WORLD senders][CAPACITY rows][WIDTH]."""
    return buffer.view(WORLD, CAPACITY, WIDTH)[sender, :rows]


def unwritten(t: torch.Tensor) -> torch.Tensor:
    """Which elements hold the "unwritten" pattern (every bit set)."""
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32) == -1


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("with_residual", [True, False])
def test_oneway_sum_reads_the_peers_row_and_leaves_its_slot_unwritten(
    dtype: torch.dtype, rows: int, with_residual: bool
) -> None:
    first, second, residual, weight = rows_of(rows, dtype, seed=rows)
    regions = [torch.empty(WORLD * CAPACITY * WIDTH, dtype=dtype, device=DEVICE) for _ in range(WORLD)]
    for region in regions:
        fill_unwritten(region)
    buffers = addresses(regions)
    stream = residual if with_residual else None
    want = flagged_sum(first, second, stream, weight)

    def run(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        partial = (first, second)[rank]
        return oneway_sum_add_rms_norm(partial, stream, weight, EPS, buffers=buffers, rank=rank, world=WORLD,
                                       capacity=CAPACITY, region_offset=0)

    slot(regions[0], 1, rows).copy_(second)  # rank 1's row has landed in rank 0's region
    normed, summed = run(0)
    assert torch.equal(normed, want[0]) and torch.equal(summed, want[1])
    assert_near((normed, summed), reference(first, second, stream, weight))
    assert bool(unwritten(regions[0]).all())  # rank 0 read its slot and cleared it for the region's next sum
    assert torch.equal(slot(regions[1], 0, rows), first)  # its own row went to rank 1's slot, nothing else
    assert bool(unwritten(slot(regions[1], 0, CAPACITY)[rows:]).all()) and bool(unwritten(slot(regions[1], 1, CAPACITY)).all())

    slot(regions[0], 1, rows).fill_(0)  # rank 1's program rewrites it; zeros show the write happened
    normed_1, summed_1 = run(1)
    assert torch.equal(normed_1, normed) and torch.equal(summed_1, summed)  # the same bits on both ranks
    assert bool(unwritten(regions[1]).all()) and torch.equal(slot(regions[0], 1, rows), second)


@needs_triton
def test_oneway_sum_never_sends_the_unwritten_pattern() -> None:
    """A NaN with every bit set in a partial row goes out as the NaN with the sign bit clear (the reader would
    otherwise wait for it forever); the sum is NaN there on both ranks and exact elsewhere."""
    first, second, residual, weight = rows_of(1, torch.bfloat16, seed=7)
    first.view(torch.int16)[0, 5] = -1
    regions = [torch.empty(WORLD * CAPACITY * WIDTH, dtype=torch.bfloat16, device=DEVICE) for _ in range(WORLD)]
    for region in regions:
        fill_unwritten(region)
    buffers = addresses(regions)
    slot(regions[0], 1, 1).copy_(second)
    _, summed = oneway_sum_add_rms_norm(first, residual, weight, EPS, buffers=buffers, rank=0, world=WORLD,
                                        capacity=CAPACITY, region_offset=0)
    sent = slot(regions[1], 0, 1)
    assert int(sent.view(torch.int16)[0, 5]) == 0x7FFF and bool(sent[0, 5].isnan())
    assert bool(summed[0, 5].isnan()) and not bool(summed[0, :5].isnan().any())
    _, summed_1 = oneway_sum_add_rms_norm(second, residual, weight, EPS, buffers=buffers, rank=1, world=WORLD,
                                          capacity=CAPACITY, region_offset=0)
    assert bool(summed_1[0, 5].isnan())
    assert torch.equal(summed_1[0, :5], summed[0, :5]) and torch.equal(summed_1[0, 6:], summed[0, 6:])


@needs_triton
@pytest.mark.parametrize("rows", [1, 3])
def test_flagged_sum_reads_the_peers_row_once_its_flag_is_up(rows: int) -> None:
    first, second, residual, weight = rows_of(rows, torch.bfloat16, seed=10 + rows)
    buffers_t = [torch.zeros(WORLD * CAPACITY * WIDTH, dtype=torch.bfloat16, device=DEVICE) for _ in range(WORLD)]
    pads = [torch.zeros(CAPACITY * WORLD, dtype=torch.int32, device=DEVICE) for _ in range(WORLD)]
    buffers, pad_addresses = addresses(buffers_t), addresses(pads)

    def run(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        return sum_add_rms_norm((first, second)[rank], residual, weight, EPS, buffers=buffers, pads=pad_addresses,
                                rank=rank, world=WORLD, capacity=CAPACITY, region_offset=0, first_flag=0)

    slot(buffers_t[0], 1, rows).copy_(second)
    pads[0].view(CAPACITY, WORLD)[:rows, 1] = 1  # rank 1's flags for these rows, raised in rank 0's pad
    normed, summed = run(0)
    assert_near((normed, summed), reference(first, second, residual, weight))
    assert int(pads[0].sum()) == 0  # lowered after reading
    assert pads[1].view(CAPACITY, WORLD)[:, 0].tolist() == [1] * rows + [0] * (CAPACITY - rows)
    assert torch.equal(slot(buffers_t[1], 0, rows), first)
    normed_1, summed_1 = run(1)
    assert torch.equal(normed_1, normed) and torch.equal(summed_1, summed) and int(pads[1].sum()) == 0
