"""Forwards whose every shape and address is fixed, so a CUDA graph can capture them once and replay them.

The host-side cache length of the eager path becomes a device tensor here: new K/V rows are scattered to slots
`length + i` with `index_copy_`, and attention reads a fixed *bucket* of slots (a power of two >= the slots in
use) with a mask that hides the slots past the live ones. The same functions run eagerly on any device (that is
how the CPU tests check them against the eager path); `dflash.fastpath.runner` captures them on CUDA.
"""

from __future__ import annotations

from typing import Any

import torch

from dflash.drafter.model import DFlashDrafter, TargetHeads
from dflash.kv.cache import KVCache
from dflash.kv.recurrent import RecurrentStates
from dflash.models.model import CausalLM


class SlotWriter:
    """A `CacheWriter` that scatters new K/V rows to device-computed slots and reads a fixed bucket of slots."""

    def __init__(self, storage: KVCache, slots: torch.Tensor, bucket: int) -> None:
        self.storage, self.slots, self.bucket = storage, slots, bucket  # slots: [rows] long

    @property
    def recurrent_segments(self) -> list[tuple[slice, RecurrentStates]] | None:
        """The storage's linear-attention state, for every row (a hybrid model's static forward)."""
        recurrent = self.storage.recurrent
        return None if recurrent is None else [(slice(0, int(self.slots.shape[0])), recurrent)]

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """keys/values: [1, kv_heads, rows, head_dim] -> views [1, kv_heads, bucket, head_dim] (a layer narrower
        than the storage uses its first heads and lanes)."""
        heads, width = keys.shape[1], keys.shape[3]
        stored_keys = self.storage.keys[layer, :, :heads, :, :width]
        stored_values = self.storage.values[layer, :, :heads, :, :width]
        stored_keys.index_copy_(2, self.slots, keys)
        stored_values.index_copy_(2, self.slots, values)
        return stored_keys[:, :, : self.bucket], stored_values[:, :, : self.bucket]


def block_visibility(length: torch.Tensor, tree_mask: torch.Tensor, bucket: int) -> torch.Tensor:
    """Which of `bucket` slots each new row sees: every committed slot (< length) and, among the new rows stored
    at slots length .. length+rows-1, those `tree_mask` allows.

    length: [1] long; tree_mask: [rows, rows] bool -> [rows, bucket] bool."""
    rows = tree_mask.shape[0]
    relative = torch.arange(bucket, device=tree_mask.device) - length  # [bucket]
    in_block = (relative >= 0) & (relative < rows)
    block_part = tree_mask[:, relative.clamp(0, rows - 1)] & in_block  # [rows, bucket]
    return (relative < 0) | block_part


def static_target_forward(
    model: CausalLM,
    storage: KVCache,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    length: torch.Tensor,
    tree_mask: torch.Tensor,
    *,
    bucket: int,
    capture: tuple[int, ...],
    fused: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One target pass over `rows` new tokens stored after the `length` committed slots of `storage`.

    input_ids, positions: [1, rows]; length: [1] long; tree_mask: [rows, rows] bool (causal for a chain, ancestors
    for a tree) -> (logits [1, rows, vocab], features [1, rows, len(capture) * hidden] or None). `fused` runs the
    layers through the fused kernels (`dflash.fastpath.fused_layers`; the model must support them)."""
    if fused:
        from dflash.fastpath.fused_layers import fused_layers, fused_logits

        if model.config.is_hybrid:
            from dflash.fastpath.fused_hybrid import fused_hybrid_layers

            layers = fused_hybrid_layers
        else:
            layers = fused_layers
        hidden, features = layers(model, storage, input_ids, positions, length, tree_mask, bucket, capture)
        return fused_logits(model, hidden[0])[None], features
    rows = input_ids.shape[1]
    slots = length + torch.arange(rows, device=input_ids.device)  # [rows]
    storage.positions[0].index_copy_(0, slots, positions[0])
    full = block_visibility(length, tree_mask, bucket)[None, None]  # [1, 1, rows, bucket]
    sliding = None
    window = model.config.sliding_window
    if window is not None and any(model.sliding):
        key_positions = storage.positions[0, :bucket]  # [bucket]
        sliding = full & (positions[0][:, None] - key_positions[None, :] < window)
    x, features = model.run_layers(input_ids, positions, full, sliding, SlotWriter(storage, slots, bucket), capture)
    out = model.finish(x, features, "all")
    assert out.logits is not None
    return out.logits, out.features


def static_drafter_hidden(
    drafter: DFlashDrafter,
    target: TargetHeads,
    storage: KVCache,
    block_ids: torch.Tensor,
    start: torch.Tensor,
    new_rows: torch.Tensor,
    new_features: torch.Tensor,
    *,
    bucket: int,
    drafts: int,
) -> torch.Tensor:
    """One drafter round up to the final norm: append the context rows of the newly committed positions, then fill
    the block.

    block_ids: [1, B] (the pending token, then MASK); start: [1] long, the pending token's position; new_rows:
    [1] long, how many of the B rows of new_features [1, B, n*target_hidden] are real (positions start-new_rows ..
    start-1; the others are scratch written past the live slots) -> hidden [drafts, hidden] of positions start+1 ..
    start+drafts (`drafter.project` makes them logits; a DFlash2 drafter's embedding scale and block rule included).
    The drafter cache holds one slot per position."""
    block = block_ids.shape[1]
    device = block_ids.device
    dtype = drafter.fc.weight.dtype
    offsets = torch.arange(block, device=device)
    context_slots = start - new_rows + offsets  # [B]
    storage.positions[0].index_copy_(0, context_slots, context_slots)
    context = drafter.context(new_features)  # [1, B, hidden]
    context_cos, context_sin = drafter.rotary.cos_sin(context_slots[None], dtype)
    block_positions = (start + offsets)[None]  # [1, B]
    cos, sin = drafter.rotary.cos_sin(block_positions, dtype)
    live = torch.cat((torch.arange(bucket, device=device) < start, torch.ones(block, dtype=torch.bool, device=device)))
    full = live.expand(block, -1)[None, None]  # [1, 1, B, bucket + B]
    sliding = full
    if any(drafter.sliding):
        key_positions = torch.cat((storage.positions[0, :bucket], block_positions[0]))  # [bucket + B]
        query = block_positions[0][:, None]
        window = drafter.config.sliding_window or 1 << 30
        visible = query - key_positions[None] < window
        if drafter.sliding_block_causal:  # else (DFlash2 `is_causal: false`) the whole block sees itself
            visible = visible & (key_positions[None] <= query)
        sliding = full & visible[None, None]
    embeds = target.embed(block_ids)
    scale = getattr(drafter.config, "input_embedding_scale", 1.0)  # DFlash2's, as in its `draft_hidden`
    x = (embeds if scale == 1.0 else embeds * scale).to(dtype)
    layer: Any
    for index, layer in enumerate(drafter.layers):
        k, v = layer.self_attn.keys_values(context, context_cos, context_sin)  # [1, kv_heads, B, head_dim]
        storage.keys[index].index_copy_(2, context_slots, k)
        storage.values[index].index_copy_(2, context_slots, v)
        context_k = storage.keys[index, :, :, :bucket]
        context_v = storage.values[index, :, :, :bucket]
        x = layer(x, cos, sin, context_k, context_v, sliding if drafter.sliding[index] else full)
    return drafter.norm(x)[0, 1 : 1 + drafts]
