"""One packed drafter round for every speculating request of a step.

Per request: absorb the features of its newly committed positions as drafter context (their keys and values in
every drafter layer, written to the drafter pool), then run its block [pending, MASK x (B-1)] at positions
start .. start+B-1, non-causal inside the block (sliding layers causal within their window). All requests' context
rows and block rows go through each projection together; attention is per request over its own pool rows.
A DFlash2 drafter's layers also convolve each block (`dflash.drafter.block_conv`), and `run_selector` gives its
candidate lattices instead of scores.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from dflash.batch.attention import PackedAttention, segment
from dflash.batch.pool import BlockPool, SlotTable
from dflash.batch.target_pass import TargetRows
from dflash.drafter.dflash2 import DFlash2Drafter
from dflash.drafter.model import DFlashDrafter
from dflash.drafter.selector import CandidateLattice
from dflash.drafter.vocab import DraftScores
from dflash.models.model import CausalLM

if TYPE_CHECKING:
    from dflash.batch.graphs import GraphedDrafterPasses


@dataclass(frozen=True)
class DraftRows:
    """One request's part of a drafter round."""

    table: SlotTable  # its drafter context; committed positions 0 .. table.length-1
    new_features: torch.Tensor  # [new, n*target_hidden]: the features of positions table.length ..
    pending: int  # the committed token at `start`, block slot 0
    start: int
    outputs: int  # draft rows wanted: positions start+1 .. start+outputs
    window: int | None = None  # read only the last `window` context positions


def run_drafter(
    drafter: DFlashDrafter, target: CausalLM, pool: BlockPool, items: Sequence[DraftRows],
    graphs: GraphedDrafterPasses | None = None,
) -> list[DraftScores]:
    """Draft scores per request: [outputs, shortlist or vocab]. Advances each table over its new context rows.
    With `graphs` (CUDA) the context rows' write and the block pass are graph replays."""
    _prepare(drafter, pool, items, graphs)
    if graphs is not None and all(item.window is None for item in items) and not isinstance(drafter, DFlash2Drafter):
        return _graphed_blocks(drafter, graphs, items)
    scores = drafter.project_scores(target, _block_hidden(drafter, target, pool, items))  # [sum outputs, columns]
    parts = scores.logits.split([item.outputs for item in items])
    return [DraftScores(part, scores.ids, scores.vocab_size) for part in parts]


def run_selector(
    drafter: DFlash2Drafter, target: CausalLM, pool: BlockPool, items: Sequence[DraftRows]
) -> list[CandidateLattice]:
    """`run_drafter` for a DFlash2 drafter: each request's candidate lattice (its selector walks it), eagerly."""
    _prepare(drafter, pool, items)
    hidden = _block_hidden(drafter, target, pool, items)  # [sum outputs, hidden]
    scores = drafter.project_scores(target, hidden)
    sizes = [item.outputs for item in items]
    return [
        drafter.candidate_selector.lattice(rows, DraftScores(logits, scores.ids, scores.vocab_size))
        for rows, logits in zip(hidden.split(sizes), scores.logits.split(sizes), strict=True)
    ]


def _prepare(
    drafter: DFlashDrafter, pool: BlockPool, items: Sequence[DraftRows], graphs: GraphedDrafterPasses | None = None
) -> None:
    """Room for every request's new context rows and block, and the new context rows absorbed."""
    block = drafter.config.block_size
    for item in items:
        item.table.reserve(item.table.length + item.new_features.shape[0] + block)
    if graphs is not None:
        graphs.context.absorb(items)
    else:
        absorb_context_rows(drafter, pool, items)


def _block_hidden(
    drafter: DFlashDrafter, target: CausalLM, pool: BlockPool, items: Sequence[DraftRows]
) -> torch.Tensor:
    """Every request's block through the drafter layers -> the final-normed draft rows [sum outputs, hidden]."""
    block = drafter.config.block_size
    device = pool.device
    segments = []
    for index, item in enumerate(items):
        positions = torch.arange(item.start, item.start + block, device=device)
        first = max(0, item.table.length - item.window) if item.window else 0
        rows = slice(index * block, (index + 1) * block)
        segments.append(segment(item.table, rows, positions, first=first, causal=False,
                                window=drafter.config.sliding_window if any(drafter.sliding) else None,
                                window_causal=drafter.sliding_block_causal))
    tokens = torch.full((len(items), block), drafter.config.mask_token_id, dtype=torch.long, device=device)
    tokens[:, 0] = torch.tensor([item.pending for item in items], device=device)
    positions = torch.stack([torch.arange(i.start, i.start + block, device=device) for i in items]).view(1, -1)
    picked = torch.cat([torch.arange(n * block + 1, n * block + 1 + i.outputs) for n, i in enumerate(items)]).to(device)
    backend = PackedAttention(pool, segments, drafter.sliding)
    cos, sin = drafter.rotary.cos_sin(positions, drafter.fc.weight.dtype)  # [1, 1, rows, head_dim]
    x = target.embed(tokens.view(1, -1)).to(drafter.fc.weight.dtype)  # [1, rows, hidden]
    layer: Any
    last = len(drafter.layers) - 1
    if isinstance(drafter, DFlash2Drafter):
        x = x * drafter.config.input_embedding_scale
        for index, layer in enumerate(drafter.layers):
            x = _convolved_layer(layer, index, x, backend, cos, sin)  # blocks end to end: taps stay in each block
        return drafter.norm(x[:, picked])[0]
    for index, layer in enumerate(drafter.layers):
        attn = layer.self_attn
        q, k, v = attn.block_qkv(layer.input_layernorm(x), cos, sin)
        attended = backend.attend(index, q, k, v, attn.head_dim**-0.5)  # [1, rows, heads * head_dim]
        if index == last:  # only the draft rows go on (every row gave its keys and values)
            x, attended = x[:, picked], attended[:, picked]
        x = x + attn.o_proj(attended)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return drafter.norm(x)[0]


def _convolved_layer(
    layer: Any, index: int, x: torch.Tensor, backend: PackedAttention, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """`DFlash2Layer.forward` with packed attention: x [1, blocks * B, hidden] -> the same rows."""
    attn = layer.self_attn
    h, kernel = layer.attention_conv.prepare(layer.input_layernorm(x))
    q, k, v = attn.block_qkv(h, cos, sin)
    attended = attn.o_proj(backend.attend(index, q, k, v, attn.head_dim**-0.5))  # [1, rows, hidden]
    x = x + layer.attention_conv.finish(attended, kernel)
    h, kernel = layer.mlp_conv.prepare(layer.post_attention_layernorm(x))
    return x + layer.mlp_conv.finish(layer.mlp(h), kernel)


def _graphed_blocks(drafter: DFlashDrafter, graphs: GraphedDrafterPasses, items: Sequence[DraftRows]) -> list[DraftScores]:
    block = drafter.config.block_size
    visible = torch.ones(block, block, dtype=torch.bool)  # the block sees itself both ways
    tokens = torch.full((len(items), block), drafter.config.mask_token_id, dtype=torch.long)  # [requests, block]
    tokens[:, 0] = torch.from_numpy(np.fromiter((item.pending for item in items), dtype=np.int64, count=len(items)))
    starts = torch.from_numpy(np.fromiter((item.start for item in items), dtype=np.int64, count=len(items)))
    positions = starts[:, None] + torch.arange(block)[None]  # [requests, block]
    rows = [TargetRows(item.table, tokens[i], positions[i], visible) for i, item in enumerate(items)]
    logits = graphs.run(rows, [item.outputs for item in items])
    return [DraftScores(part, None, part.shape[-1]) for part in logits]


def store_context(
    drafter: DFlashDrafter, pool: BlockPool, features: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor
) -> None:
    """Context rows as keys and values of every drafter layer, written to their pool slots: features [b, n,
    n*target_hidden] of positions [b, n], slots [b * n] (row-major; fixed shapes, so a graph can capture it)."""
    ctx = drafter.context(features)  # [b, n, hidden]
    cos, sin = drafter.rotary.cos_sin(positions, ctx.dtype)
    layer: Any
    for index, layer in enumerate(drafter.layers):
        k, v = layer.self_attn.keys_values(ctx, cos, sin)  # [b, kv_heads, n, head_dim]
        kv_heads, dim = k.shape[1], k.shape[3]
        pool.keys[index].index_copy_(1, slots, k.transpose(0, 1).reshape(kv_heads, -1, dim).to(pool.keys.dtype))
        pool.values[index].index_copy_(1, slots, v.transpose(0, 1).reshape(kv_heads, -1, dim).to(pool.values.dtype))


def absorb_context_rows(drafter: DFlashDrafter, pool: BlockPool, items: Sequence[DraftRows]) -> None:
    """Write the context keys/values of every request's new features and commit them in its table."""
    live = [item for item in items if item.new_features.shape[0]]
    if not live:
        return
    device = pool.device
    features = torch.cat([item.new_features for item in live])[None]  # [1, new, n*target_hidden]
    # each request's new positions length .. length + count - 1, end to end: [new] (made on the device: a copy from
    # the host would wait for the round the GPU may be running)
    positions = torch.cat([
        torch.arange(i.table.length, i.table.length + i.new_features.shape[0], device=device) for i in live
    ])[None]
    slots = torch.cat([i.table.slots(i.table.length, i.table.length + i.new_features.shape[0]) for i in live])
    store_context(drafter, pool, features, positions, slots)
    for item in live:
        item.table.crop(item.table.length + item.new_features.shape[0])
