"""The drafter's context rows written through padded row buckets (`dflash.batch.context_store`) write the keys and
values the packed eager write does, at the same slots, and nothing else but the trash slot: run eagerly on the CPU
and, marked, as graphs on a GPU."""

from __future__ import annotations

import pytest
import torch

from dflash.batch.context_store import ROW_BUCKETS, ContextStores
from dflash.batch.draft_pass import DraftRows, absorb_context_rows
from dflash.batch.pool import BlockPool, SlotTable
from tests.spec_helpers import golden_pair, one_torch_thread

_one_thread = one_torch_thread  # autouse, module scope

# rows per request: two small writes share a bucket; the long one crosses the largest bucket and is split
ROWS = (5, 37, ROW_BUCKETS[-1] + 70, 12)
ALREADY = (0, 9, 3, 40)  # committed positions before the write


def _write(device: torch.device, graphed: bool | None) -> tuple[BlockPool, list[SlotTable]]:
    """The same features through the stores (`graphed`) or the packed eager write (None) -> (pool, tables)."""
    _, drafter = golden_pair(str(device))
    config = drafter.config
    pool = BlockPool(config.num_layers, config.num_kv_heads, config.head_dim, 96, 16,
                     dtype=drafter.fc.weight.dtype, device=device)
    pool.keys.zero_()
    pool.values.zero_()
    generator = torch.Generator().manual_seed(5)
    tables, items = [], []
    for rows, already in zip(ROWS, ALREADY, strict=True):
        table = SlotTable(pool)
        table.reserve(already + rows)
        table.crop(already)
        features = torch.randn(rows, config.feature_size, generator=generator).to(device, drafter.fc.weight.dtype)
        tables.append(table)
        items.append(DraftRows(table, features, 0, 0, 0))
    memory = torch.cuda.graph_pool_handle() if graphed else None
    if graphed is None:
        absorb_context_rows(drafter, pool, items)
    else:
        ContextStores(drafter, pool, memory, graphed=graphed).absorb(items)
    return pool, tables


def _compare(device: torch.device, graphed: bool, tolerance: float) -> None:
    stored, tables = _write(device, graphed)
    expected, expected_tables = _write(device, None)
    for table, reference, rows, already in zip(tables, expected_tables, ROWS, ALREADY, strict=True):
        assert table.length == reference.length == already + rows
        written = table.slots(already, already + rows)
        for got, want in ((stored.keys, expected.keys), (stored.values, expected.values)):
            assert got[:, :, written].abs().sum() > 0
            torch.testing.assert_close(got[:, :, written], want[:, :, written], atol=tolerance, rtol=tolerance)
    # no other slot is written (the trash slot takes the padding rows)
    untouched = torch.ones(stored.trash_slot + 1, dtype=torch.bool)
    for table, rows, already in zip(tables, ROWS, ALREADY, strict=True):
        untouched[table.slots(already, already + rows).cpu()] = False
    untouched[stored.trash_slot] = False
    assert stored.keys[:, :, untouched.to(device)].abs().sum() == 0
    assert stored.values[:, :, untouched.to(device)].abs().sum() == 0


def test_stores_write_what_the_packed_write_writes() -> None:
    _compare(torch.device("cpu"), False, 1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_graphed_stores_write_what_the_packed_write_writes() -> None:
    _compare(torch.device("cuda"), True, 1e-3)
