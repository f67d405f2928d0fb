"""The graphed forwards' setup programs (`dflash.kernels.triton_round_setup`) against the torch ops they replace."""

from __future__ import annotations

import pytest
import torch

from dflash.fastpath.static_forward import block_visibility
from dflash.kernels.triton_decode import triton_available
from dflash.models.rope import Rotary

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(
    DEVICE.type != "cuda" or not triton_available(), reason="Triton programs on a GPU"
)


def rotary_table(length: int) -> tuple[Rotary, tuple[torch.Tensor, torch.Tensor]]:
    rotary = Rotary(64, 10000.0).to(DEVICE)
    rotary.prepare_table(length, torch.bfloat16, DEVICE)
    table = rotary.table(torch.bfloat16, DEVICE)
    assert table is not None
    return rotary, table


@pytest.mark.parametrize(("rows", "bucket", "length"), [(1, 256, 37), (16, 512, 300), (40, 1024, 700), (128, 512, 0)])
def test_target_setup_matches_torch(rows: int, bucket: int, length: int) -> None:
    from dflash.kernels.triton_round_setup import target_setup

    generator = torch.Generator().manual_seed(rows)
    rotary, table = rotary_table(2048)
    positions = torch.randint(0, 2000, (rows,), generator=generator).to(DEVICE)
    tree_mask = (torch.rand((rows, rows), generator=generator) < 0.5).to(DEVICE)
    stored = torch.full((2048,), -1, dtype=torch.long, device=DEVICE)
    expected_stored = stored.clone()
    length_t = torch.tensor([length], device=DEVICE)
    slots, additive, cos, sin = target_setup(length_t, positions, tree_mask, stored, table, bucket, torch.bfloat16)
    expected_slots = length + torch.arange(rows, device=DEVICE)
    expected_stored.index_copy_(0, expected_slots, positions)
    visible = block_visibility(length_t, tree_mask, bucket)
    expected_cos, expected_sin = rotary.rows_cos_sin(positions, torch.bfloat16)
    assert torch.equal(slots, expected_slots) and torch.equal(stored, expected_stored)
    assert torch.equal(additive == 0, visible) and torch.isneginf(additive[~visible]).all()
    assert additive.dtype == torch.bfloat16
    assert torch.equal(cos, expected_cos) and torch.equal(sin, expected_sin)


@pytest.mark.parametrize(("new_rows", "start", "bucket"), [(1, 40, 256), (9, 300, 512), (16, 1000, 1024)])
def test_drafter_setup_matches_torch(new_rows: int, start: int, bucket: int) -> None:
    from dflash.kernels.triton_round_setup import drafter_setup

    block = 16
    rotary, table = rotary_table(2048)
    stored = torch.full((2048,), -1, dtype=torch.long, device=DEVICE)
    start_t, new_rows_t = torch.tensor([start], device=DEVICE), torch.tensor([new_rows], device=DEVICE)
    slots, additive, cos, sin = drafter_setup(start_t, new_rows_t, block, stored, table, bucket, torch.bfloat16)
    offsets = torch.arange(block, device=DEVICE)
    context = start - new_rows + offsets
    expected_slots = torch.cat((torch.where(offsets < new_rows, context, -1), start + offsets))
    expected_cos, expected_sin = rotary.rows_cos_sin(torch.cat((context, start + offsets)), torch.bfloat16)
    assert torch.equal(slots, expected_slots)
    assert torch.equal(stored[context], context) and (stored[: start - new_rows] == -1).all()
    visible = torch.arange(bucket, device=DEVICE) < start + block
    assert torch.equal(additive == 0, visible) and torch.isneginf(additive[~visible]).all()
    assert torch.equal(cos, expected_cos) and torch.equal(sin, expected_sin)
