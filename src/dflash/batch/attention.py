"""Attention of a packed batch over the paged pool: every request's rows see only that request's keys.

A batched step packs the new rows of all its requests into one sequence [1, rows] (prefill chunks, verification
blocks, tree nodes, plain decoding steps), so every projection reads the weights once for all of them. Attention is
the one per-request operation: `PackedAttention` is the layers' `AttentionBackend`; per layer it stores all new K/V in
the pool with one scatter, then attends each request's query rows to its committed positions plus its own new rows,
under that request's mask (causal chain, tree ancestors, or all-visible for a drafter block).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dflash.batch.pool import BlockPool, SlotTable
from dflash.kernels.fused_cpu import layer_ops
from dflash.kv.cache import PackedRows
from dflash.kv.recurrent import RecurrentStates
from dflash.models.layers import FUSED_ATTENTION_MAX_ROWS, fits_attention_kernel


@dataclass(frozen=True)
class Segment:
    """One request's rows in a packed forward, and what they may read."""

    rows: slice  # its rows in the packed sequence
    read_slots: torch.Tensor  # int64 [keys]: the committed positions it reads, then its new rows' slots
    write_slots: torch.Tensor  # int64 [rows]: where its new rows' K/V go
    full_mask: torch.Tensor | None  # bool [1, 1, rows, keys] for full-attention layers; None: every key visible
    sliding_mask: torch.Tensor | None  # the same for sliding-window layers


def segment(
    table: SlotTable,
    rows: slice,
    positions: torch.Tensor,
    *,
    first: int = 0,
    visibility: torch.Tensor | None = None,
    causal: bool = True,
    window: int | None = None,
    window_causal: bool = True,
) -> Segment:
    """The segment of a request whose new rows (at `positions` [n], written after its `table.length` committed
    positions) read committed positions [first, table.length) and each other: by `visibility` [n, n] (a tree's
    ancestor-or-self mask), else causally when `causal`, else all both ways (a drafter block). `window`: the
    sliding layers' window, causal by position unless `window_causal` is False (then the new rows also see each
    other both ways, as a DFlash2 block does)."""
    past, count = table.length, rows.stop - rows.start
    write = table.slots(past, past + count)
    read = torch.cat((table.slots(first, past), write))
    device = positions.device
    committed = past - first
    if visibility is None and causal and count > 1:
        visibility = torch.ones(count, count, dtype=torch.bool, device=device).tril()
    full: torch.Tensor | None = None
    if visibility is not None:
        full = torch.cat((torch.ones(count, committed, dtype=torch.bool, device=device), visibility.to(device)), 1)
        full = full[None, None]  # [1, 1, n, keys]
    sliding = None
    if window is not None:
        key_positions = torch.cat((torch.arange(first, past, device=device), positions))  # [keys]
        distance = positions[:, None] - key_positions[None, :]  # [n, keys]
        in_window = (((distance >= 0) | (not window_causal)) & (distance < window))[None, None]
        sliding = in_window if full is None else full & in_window
    return Segment(rows, read, write, full, sliding)


class PackedAttention:
    """`AttentionBackend` of one packed forward over `pool` (`sliding[layer]`: that layer uses the window).

    For a hybrid model, `recurrent_segments` pairs each request's rows with its linear-attention state, which the
    linear layers read and update (`dflash.models.gated_deltanet`)."""

    def __init__(
        self,
        pool: BlockPool,
        segments: Sequence[Segment],
        sliding: Sequence[bool],
        recurrent: Sequence[RecurrentStates | None] = (),
    ) -> None:
        self.pool, self.segments, self.sliding = pool, list(segments), list(sliding)
        self.write_slots = torch.cat([s.write_slots for s in self.segments])  # [rows]
        self.recurrent_segments: list[tuple[slice, RecurrentStates | None]] | None = None
        if any(state is not None for state in recurrent):
            self.recurrent_segments = [(s.rows, state) for s, state in zip(self.segments, recurrent, strict=True)]

    def native_rows(self) -> PackedRows | None:
        """This forward for the native decoder layers, or None where `attend` would not take the fused CPU
        attention for every segment (a long prompt chunk, a linear-attention state) or a layer uses the window."""
        if self.recurrent_segments is not None or any(self.sliding) or self.pool.keys.dtype != torch.float32:
            return None
        segments = []
        for s in self.segments:
            count = s.rows.stop - s.rows.start
            mask = s.full_mask
            if count > FUSED_ATTENTION_MAX_ROWS or (mask is not None and (mask.dtype != torch.bool or mask.dim() != 4)):
                return None
            segments.append((s.rows.start, count, s.read_slots, None if mask is None else mask[0, 0]))
        return PackedRows(self.pool.keys, self.pool.values, self.write_slots, segments)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """q: [1, heads, rows, head_dim]; k, v: [1, kv_heads, rows, head_dim] -> [1, rows, heads * head_dim]."""
        # [kv_heads, slots, head_dim]: a layer narrower than the pool (Gemma 4) uses the first heads and lanes
        keys = self.pool.keys[layer, : k.shape[1], :, : k.shape[3]]
        values = self.pool.values[layer, : v.shape[1], :, : v.shape[3]]
        keys.index_copy_(1, self.write_slots, k[0].to(keys.dtype))
        values.index_copy_(1, self.write_slots, v[0].to(values.dtype))
        sliding = self.sliding[layer] if layer < len(self.sliding) else False
        masks = [s.sliding_mask if sliding else s.full_mask for s in self.segments]
        ops = layer_ops(q)
        if ops is not None and len(self.segments) > 1 and all(
            fits_attention_kernel(q[:, :, s.rows], mask) for s, mask in zip(self.segments, masks, strict=True)
        ):  # every request's rows in one call: one parallel region, no concatenation
            return ops.attention_segments(
                q[0], keys, values, [s.rows.start for s in self.segments],
                [s.rows.stop - s.rows.start for s in self.segments], [s.read_slots for s in self.segments],
                [None if mask is None else mask[0, 0] for mask in masks], scale,
            )[None]
        outs = [attend_rows(q[:, :, s.rows], keys, values, s.read_slots, mask, scale)
                for s, mask in zip(self.segments, masks, strict=True)]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)


def attend_rows(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """q: [1, heads, n, head_dim] over the pool rows `slots` of keys/values [kv_heads, slots, head_dim], mask
    [1, 1, n, len(slots)] or None -> [1, n, heads * head_dim]."""
    ops = layer_ops(q)
    if ops is not None and fits_attention_kernel(q, mask):  # reads the pool in place through the slots
        return ops.attention_slots(q[0], keys, values, slots, None if mask is None else mask[0, 0], scale)[None]
    k = keys.index_select(1, slots)[None]  # [1, kv_heads, keys, head_dim]
    v = values.index_select(1, slots)[None]
    heads, kv_heads = q.shape[1], k.shape[1]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=heads != kv_heads)
    return out.transpose(1, 2).reshape(1, q.shape[2], -1)
