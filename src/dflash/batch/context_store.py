"""The drafter's context rows written to its pool through CUDA graphs.

Before a request's rounds, the drafter reads its context as keys and values in every drafter layer: the target's
features of every committed position, written by `store_context` (a prompt's rows as its prefill ends, the rows of
plain steps taken since the request's last round). Run eagerly, a write is a hundred small launches, whatever the row
count, once per arriving request (the engine loop's time it took under load: results/gpu_concurrency_h100_arrivals.json,
`arrival_probe_32_clients`). Here the rows of
every request in a call are packed into a padded row bucket and written by one graph replay; padding rows write to
the pool's trash slot. Rows beyond the largest bucket go in several replays. Built with `graphed=False` (off CUDA,
tests), the same buffers are loaded and the same pass runs eagerly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dflash.batch.draft_pass import DraftRows, store_context
from dflash.batch.padded import bucket_up
from dflash.batch.pool import BlockPool, SlotTable
from dflash.drafter.model import DFlashDrafter
from dflash.fastpath.capture import capture_graph

ROW_BUCKETS = (16, 64, 256, 1024)  # rows per write: a few graphs; a longer prompt takes several replays


@dataclass
class _Entry:
    graph: torch.cuda.CUDAGraph | None  # None: the write runs eagerly at each replay
    features: torch.Tensor  # [1, rows, n*target_hidden]
    positions: torch.Tensor  # [1, rows]
    slots: torch.Tensor  # [rows]: the trash slot for padding rows


@dataclass(frozen=True)
class _Piece:
    table: SlotTable
    first: int  # position of its first row
    features: torch.Tensor  # [rows, n*target_hidden]


class ContextStores:
    def __init__(self, drafter: DFlashDrafter, pool: BlockPool, memory: Any, *, graphed: bool = True) -> None:
        self.drafter = drafter
        self.pool = pool
        self.memory = memory
        self.graphed = graphed
        self._entries: dict[int, _Entry] = {}

    def absorb(self, items: Sequence[DraftRows]) -> None:
        """Write the context keys/values of every request's new features and commit them in its table (what
        `dflash.batch.draft_pass.absorb_context_rows` does, through the graphs)."""
        top = ROW_BUCKETS[-1]
        live = [item for item in items if item.new_features.shape[0]]
        chunk: list[_Piece] = []
        rows = 0
        for item in live:
            features = item.new_features
            for lo in range(0, features.shape[0], top):
                piece = _Piece(item.table, item.table.length + lo, features[lo : lo + top])
                if rows + piece.features.shape[0] > top:
                    self._write(chunk, rows)
                    chunk, rows = [], 0
                chunk.append(piece)
                rows += piece.features.shape[0]
        if chunk:
            self._write(chunk, rows)
        for item in live:
            item.table.crop(item.table.length + item.new_features.shape[0])

    def _write(self, pieces: list[_Piece], rows: int) -> None:
        bucket = bucket_up(rows, ROW_BUCKETS)
        entry = self._entries.get(bucket) or self._capture(bucket)
        offset = 0
        for piece in pieces:
            count = piece.features.shape[0]
            entry.features[0, offset : offset + count].copy_(piece.features)
            torch.arange(piece.first, piece.first + count, out=entry.positions[0, offset : offset + count])
            entry.slots[offset : offset + count].copy_(piece.table.slots(piece.first, piece.first + count))
            offset += count
        entry.slots[offset:].fill_(self.pool.trash_slot)
        if entry.graph is not None:
            entry.graph.replay()
        else:
            self._store(entry)

    def _store(self, entry: _Entry) -> None:
        store_context(self.drafter, self.pool, entry.features, entry.positions, entry.slots)

    def _capture(self, rows: int) -> _Entry:
        device = self.pool.device
        drafter = self.drafter
        entry = _Entry(
            None,
            torch.zeros((1, rows, drafter.config.feature_size), dtype=drafter.fc.weight.dtype, device=device),
            torch.zeros((1, rows), dtype=torch.long, device=device),
            torch.full((rows,), self.pool.trash_slot, dtype=torch.long, device=device),
        )
        self._entries[rows] = entry
        if self.graphed:  # every row is padding while it is captured: only the trash slot is written
            entry.graph, _ = capture_graph(lambda: self._store(entry), self.memory)
        return entry
