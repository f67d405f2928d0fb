"""The rotary table of the graphed forwards (`Rotary.prepare_table` / `rows_cos_sin`) against `Rotary.cos_sin`."""

from __future__ import annotations

import pytest
import torch

from dflash.models.rope import Rotary


@pytest.mark.parametrize("scaling", [None, {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 64}])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_table_rows_equal_computed_rows(scaling: dict[str, object] | None, dtype: torch.dtype) -> None:
    rotary = Rotary(64, 100000.0, scaling)
    positions = torch.tensor([0, 5, 5, 130, 7, 511])  # repeated and unordered, as tree rows are
    computed = rotary.rows_cos_sin(positions, dtype)  # no table yet: computed
    cos, sin = rotary.cos_sin(positions[None], dtype)
    assert torch.equal(computed[0], cos[0, 0]) and torch.equal(computed[1], sin[0, 0])
    rotary.prepare_table(512, dtype, positions.device)
    gathered = rotary.rows_cos_sin(positions, dtype)
    assert gathered[0].shape == (6, 64) and gathered[0].is_contiguous()
    assert torch.equal(gathered[0], computed[0]) and torch.equal(gathered[1], computed[1])  # bit for bit
    rotary.recompute()  # new frequencies: the table is dropped
    assert not rotary._tables
