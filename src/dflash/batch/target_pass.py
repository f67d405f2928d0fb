"""One packed target forward over the new rows of every request in a step.

Each request contributes a run of rows written after its committed positions: a prefill chunk, a plain decoding
step, a linear verification block or a DDTree tree (with its ancestor mask). The projections and the LM head run
once over all rows; attention runs per request over the paged pool (`dflash.batch.attention`). A hybrid model's
linear-attention layers advance each request's own recurrent state by its rows; a tree's rows each from their
path (`RecurrentStates.tree_ancestors`, set for this pass as the single-request forward sets it).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import cached_property

import torch

from dflash.batch.attention import PackedAttention, segment
from dflash.batch.pool import BlockPool, SlotTable
from dflash.kernels.fused_cpu import layer_ops
from dflash.models.model import CausalLM


@dataclass(frozen=True)
class TargetRows:
    """One request's part of a target pass."""

    table: SlotTable  # its target positions; the rows go after table.length
    tokens: torch.Tensor  # int64 [n]
    positions: torch.Tensor  # int64 [n]
    visibility: torch.Tensor | None = None  # bool [n, n] among the rows (a tree); None: causal
    logit_rows: slice = field(default_factory=lambda: slice(0, 0))  # its rows (relative) whose logits are wanted

    @cached_property
    def count(self) -> int:
        """The number of rows n (read once: a step asks for it in several places, per request)."""
        return int(self.tokens.numel())


class RowViews:
    """Per-request views of one output tensor, made when read: `source[index, rows[index]]` (a step whose
    requests choose greedily from the host argmax never reads its logits)."""

    def __init__(self, source: torch.Tensor, rows: Sequence[slice]) -> None:
        self.source, self.rows = source, rows

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.source[index, self.rows[index]]

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self) -> Iterator[torch.Tensor]:
        return (self[index] for index in range(len(self.rows)))


Rows = list[torch.Tensor] | RowViews


@dataclass(frozen=True)
class TargetOutput:
    logits: Rows  # per request: [len(logit_rows), vocab]
    features: Rows | None  # per request: [n, len(capture) * hidden]
    argmax: list[list[int]] | None = None  # per request, on the host: the argmax of each logits row


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits [rows, vocab] -> the first index of each row's maximum [rows] (greedy choice's tokens)."""
    ops = layer_ops(logits) if logits.dim() == 2 and logits.is_contiguous() else None
    return logits.argmax(dim=-1) if ops is None else ops.argmax_rows(logits)


def run_target(
    model: CausalLM, pool: BlockPool, items: Sequence[TargetRows], capture: Sequence[int], *, argmax: bool = False
) -> TargetOutput:
    """Write every request's rows into `pool` (tables are not advanced: the caller commits) and compute them.
    `argmax`: also give every logits row's argmax on the host (one operation and one transfer for all requests)."""
    bounds: list[slice] = []
    row = 0
    for item in items:
        n = item.count
        item.table.reserve(item.table.length + n)
        bounds.append(slice(row, row + n))
        row += n
    window = model.sliding_window
    segments = [
        segment(item.table, rows, item.positions, visibility=item.visibility, window=window)
        for item, rows in zip(items, bounds, strict=True)
    ]
    tokens = torch.cat([item.tokens for item in items])[None]  # [1, rows]
    positions = torch.cat([item.positions for item in items])[None]  # [1, rows]
    backend = PackedAttention(pool, segments, model.sliding, [item.table.recurrent for item in items])
    # a tree's rows go through the linear layers each from its parent's state; the table's compact keeps the path
    trees = [
        (state, visibility) for item in items
        if (state := item.table.recurrent) is not None and (visibility := item.visibility) is not None
    ]
    for state, visibility in trees:
        state.tree_ancestors = visibility.to(model.embed_tokens.weight.device, torch.bool)
    try:
        hidden, features = model.run_layers(tokens, positions, None, None, backend, capture)  # [1, rows, hidden]
    finally:
        for state, _ in trees:
            state.tree_ancestors = None
    for item, rows in zip(items, bounds, strict=True):
        if item.table.recurrent is not None:  # its state took in every row; the table's crop keeps the accepted
            item.table.recurrent.advance(rows.stop - rows.start)
    picks = [torch.arange(b.start + i.logit_rows.start, b.start + i.logit_rows.stop) for i, b in zip(items, bounds, strict=True)]
    picked = torch.cat(picks).to(hidden.device)  # [wanted]
    logits = model.finish(hidden[:, picked], None, "all").logits
    assert logits is not None
    counts = [int(p.numel()) for p in picks]
    per_request = list(logits[0].split(counts))
    split_features = None
    if features is not None:
        split_features = [features[0, b] for b in bounds]
    best = None
    if argmax:
        flat: list[int] = argmax_rows(logits[0]).tolist()  # [wanted]
        best, row = [], 0
        for count in counts:
            best.append(flat[row : row + count])
            row += count
    return TargetOutput(per_request, split_features, best)
