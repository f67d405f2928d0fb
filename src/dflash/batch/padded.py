"""The decoding rows of a step in a fixed-shape layout, so that a CUDA graph can capture the target pass once per
shape and replay it every step (`dflash.batch.graphs`).

The packed layout (`dflash.batch.target_pass`) has a new shape every step and attends request by request; here
every request gets `rows` rows (its own, then padding) and `keys` key slots (its committed positions, then its new
rows, then padding), `requests` requests in all (the real ones, then padding). Shapes are bucketed so that a few
graphs serve every step. Padding never reaches a real row: padded rows write their K/V to the pool's trash slot and
no real row reads it; padded rows read a finite slot so that nothing turns NaN.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from dflash.batch.pool import BlockPool
from dflash.batch.target_pass import TargetRows
from dflash.errors import GenerationError
from dflash.models.model import CausalLM

ROW_BUCKETS = (1, 4, 8, 16, 24, 40, 64, 128)  # few shapes, few graphs: a 32-node tree takes 40
MIN_KEY_BUCKET = 128
_LOWER = np.tril(np.ones((ROW_BUCKETS[-1], ROW_BUCKETS[-1]), dtype=np.bool_))  # causal visibility among new rows


def bucket_up(value: int, buckets: Sequence[int]) -> int:
    for size in buckets:
        if value <= size:
            return size
    raise ValueError(f"{value} exceeds the largest bucket {buckets[-1]}")


@dataclass(frozen=True)
class PaddedShape:
    requests: int
    rows: int
    keys: int

    @classmethod
    def of(cls, items: Sequence[TargetRows], max_requests: int) -> PaddedShape:
        requests = 1 << max(0, (len(items) - 1).bit_length())
        rows = bucket_up(max(int(i.tokens.numel()) for i in items), ROW_BUCKETS)
        keys = max(i.table.length + int(i.tokens.numel()) for i in items)
        return cls(min(requests, max(max_requests, len(items))), rows, max(MIN_KEY_BUCKET, 1 << (keys - 1).bit_length()))


class PaddedBatch:
    """Device buffers of one shape, loaded from the step's rows before each replay."""

    def __init__(self, shape: PaddedShape, pool: BlockPool, window: int | None) -> None:
        b, r, k, device = shape.requests, shape.rows, shape.keys, pool.device
        self.shape, self.pool, self.window = shape, pool, window
        self.tokens = torch.zeros(b, r, dtype=torch.long, device=device)
        self.positions = torch.zeros(b, r, dtype=torch.long, device=device)
        self.write_slots = torch.full((b * r,), pool.trash_slot, dtype=torch.long, device=device)
        self.store_slots = torch.full((b * r,), -1, dtype=torch.long, device=device)  # padding: -1, store nothing
        self.read_slots = torch.full((b, k), pool.trash_slot, dtype=torch.long, device=device)
        self.full_mask = torch.zeros(b, 1, r, k, dtype=torch.bool, device=device)
        self.full_mask[..., 0] = True
        self.sliding_mask = self.full_mask.clone() if window is not None else None

    def load(self, items: Sequence[TargetRows]) -> None:
        """Fill the buffers for `items` (at most `shape.requests`, each within the shape). Built in numpy on the
        host (a step's per-request bookkeeping is most of a small model's step) and copied over once per buffer."""
        b, r, k = self.shape.requests, self.shape.rows, self.shape.keys
        trash = self.pool.trash_slot
        tokens = np.zeros((b, r), dtype=np.int64)
        positions = np.zeros((b, r), dtype=np.int64)
        write = np.full((b, r), trash, dtype=np.int64)
        read = np.full((b, k), trash, dtype=np.int64)
        full = np.zeros((b, r, k), dtype=np.bool_)
        full[..., 0] = True  # padded rows read one finite slot
        key_positions = np.zeros((b, k), dtype=np.int64) if self.window is not None else None
        for index, item in enumerate(items):
            n, past = int(item.tokens.numel()), item.table.length
            tokens[index, :n] = item.tokens.numpy()
            positions[index, :n] = item.positions.numpy()
            slots = item.table.host_slots(0, past + n).numpy()
            write[index, :n] = slots[past:]
            read[index, : past + n] = slots
            full[index, :n, :past] = True
            if item.visibility is None:
                full[index, :n, past : past + n] = _LOWER[:n, :n]
            else:
                full[index, :n, past : past + n] = item.visibility.numpy()
            if key_positions is not None:
                key_positions[index, :past] = np.arange(past)
                key_positions[index, past : past + n] = item.positions.numpy()
        self.tokens.copy_(torch.from_numpy(tokens), non_blocking=True)
        self.positions.copy_(torch.from_numpy(positions), non_blocking=True)
        self.write_slots.copy_(torch.from_numpy(write.reshape(-1)), non_blocking=True)
        self.store_slots.copy_(torch.from_numpy(np.where(write == trash, -1, write).reshape(-1)), non_blocking=True)
        self.read_slots.copy_(torch.from_numpy(read), non_blocking=True)
        self.full_mask.copy_(torch.from_numpy(full[:, None]), non_blocking=True)
        if self.sliding_mask is not None and self.window is not None and key_positions is not None:
            distance = positions[:, :, None] - key_positions[:, None, :]  # [b, r, k]
            sliding = full & (distance < self.window)
            sliding[..., 0] |= ~sliding.any(-1)  # a padded row keeps its finite slot
            self.sliding_mask.copy_(torch.from_numpy(sliding[:, None]), non_blocking=True)

    def additive_mask(self, dtype: torch.dtype) -> torch.Tensor:
        """The full-attention mask as additive float [requests, 1, rows, keys] (0 visible, -inf hidden)."""
        zeros = torch.zeros(self.full_mask.shape, dtype=dtype, device=self.full_mask.device)
        return zeros.masked_fill_(~self.full_mask, float("-inf"))


class PaddedAttention:
    """`AttentionBackend` of a padded batch: scatter the new K/V, gather each request's keys, one masked SDPA."""

    def __init__(self, pool: BlockPool, batch: PaddedBatch, sliding: Sequence[bool]) -> None:
        self.pool, self.batch, self.sliding = pool, batch, list(sliding)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """q: [requests, heads, rows, head_dim]; k, v: [requests, kv_heads, rows, head_dim] -> [requests, rows,
        heads * head_dim]."""
        keys, values = self.pool.keys[layer], self.pool.values[layer]  # [kv_heads, slots, head_dim]
        b, kv_heads, rows, dim = k.shape
        keys.index_copy_(1, self.batch.write_slots, k.transpose(0, 1).reshape(kv_heads, b * rows, dim))
        values.index_copy_(1, self.batch.write_slots, v.transpose(0, 1).reshape(kv_heads, b * rows, dim))
        read = self.batch.read_slots  # [requests, keys]
        gathered_k = keys[:, read].transpose(0, 1)  # [requests, kv_heads, keys, head_dim]
        gathered_v = values[:, read].transpose(0, 1)
        sliding = layer < len(self.sliding) and self.sliding[layer]
        mask = self.batch.sliding_mask if sliding and self.batch.sliding_mask is not None else self.batch.full_mask
        out = F.scaled_dot_product_attention(
            q, gathered_k, gathered_v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != kv_heads
        )
        return out.transpose(1, 2).reshape(b, rows, -1)


def padded_forward(
    model: CausalLM, pool: BlockPool, batch: PaddedBatch, capture: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The target pass over a loaded batch -> (logits [requests, rows, vocab], features [requests, rows, F] or
    None). The pool's rows past each table's length are written; nothing is committed."""
    if model.config.is_hybrid:
        raise GenerationError("the padded (CUDA graph) passes keep no linear-attention state: hybrids run packed")
    backend = PaddedAttention(pool, batch, model.sliding)
    hidden, features = model.run_layers(batch.tokens, batch.positions, None, None, backend, capture)
    logits = model.finish(hidden, None, "all").logits
    assert logits is not None
    return logits, features
