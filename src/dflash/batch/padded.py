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
from dflash.host_copies import to_device
from dflash.kernels.triton_paged_attention import paged_attention, paged_attention_usable
from dflash.models.model import CausalLM

ROW_BUCKETS = (1, 4, 8, 16, 24, 40, 64, 128, 256)  # few shapes, few graphs: a 32-node tree takes 40; 256: a prompt chunk
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
        rows = bucket_up(max(i.count for i in items), ROW_BUCKETS)
        keys = max(i.table.length + i.count for i in items)
        return cls(cls.bucket_requests(len(items), max_requests), rows, max(MIN_KEY_BUCKET, 1 << (keys - 1).bit_length()))

    @staticmethod
    def bucket_requests(count: int, max_requests: int) -> int:
        """The request bucket of `count` requests: the next power of two, or `max_requests` below it."""
        return min(1 << max(0, (count - 1).bit_length()), max(max_requests, count))


@dataclass(frozen=True)
class PlacedTokens:
    """First-row tokens already on the device (chosen by a launched step the host has not read), for some requests
    of a batch: `rows` None means the first `len(tokens)` requests, else their request indices [n]."""

    tokens: torch.Tensor  # [n] int64
    rows: torch.Tensor | None  # [n] int64, or None

    def write(self, batch_tokens: torch.Tensor) -> None:
        """Put them in a loaded batch's token buffer [requests, rows] in place of the host's."""
        if self.rows is None:
            batch_tokens[: self.tokens.shape[0], 0].copy_(self.tokens)
        else:
            batch_tokens[self.rows, 0] = self.tokens


class PaddedBatch:
    """Device buffers of one shape, loaded from the step's rows before each replay.

    The host sends little: per request its tokens and positions, its committed length and row count, its block
    table and the visibility among its new rows; the slots each row reads and writes and the attention masks
    over all `keys` are derived from them on the device (`derive`, at the start of every padded forward, so
    inside the captured graph): no [requests, rows, keys] mask is built on the host or copied over."""

    def __init__(self, shape: PaddedShape, pool: BlockPool, window: int | None) -> None:
        b, r, k, device = shape.requests, shape.rows, shape.keys, pool.device
        self.shape, self.pool, self.window = shape, pool, window
        self.key_blocks = -(-k // pool.block_size)  # block-table entries that cover `keys` positions
        # all int64 inputs in one buffer, each a contiguous part: tokens [b, r], positions [b, r], committed lengths
        # [b], row counts [b], block tables [b, kb]
        sizes = (b * r, b * r, b, b, b * self.key_blocks)
        pinned = pool.device.type == "cuda"
        # two sets of host buffers, used in turn: a step launched before the previous one was read
        # (`dflash.batch.overlap`) must not overwrite what that one's copy may still be reading
        self._host_sets = [
            (torch.zeros(sum(sizes), dtype=torch.long, pin_memory=pinned),
             torch.zeros(b, r, r, dtype=torch.bool, pin_memory=pinned))
            for _ in range(2)
        ]
        self._turn = 0
        self._ints = torch.zeros(sum(sizes), dtype=torch.long, device=device)
        tokens, positions, past, counts, blocks = self._ints.split(sizes)
        self.tokens = tokens.view(b, r)
        self.positions = positions.view(b, r)
        self.past = past  # [b]: committed positions (keys before the new rows)
        self.counts = counts  # [b]: real rows (0: a padding request)
        self.blocks = blocks.view(b, self.key_blocks)  # [b, kb]: the request's pool blocks, in position order
        self.visibility = torch.zeros(b, r, r, dtype=torch.bool, device=device)  # [b, r, r] among the new rows
        # numpy views of each set's int buffer, in the same parts (load writes through them)
        self._host_parts: list[tuple[np.ndarray, ...]] = []
        for ints, _ in self._host_sets:
            parts = np.split(ints.numpy(), np.cumsum(sizes)[:-1])
            self._host_parts.append((parts[0].reshape(b, r), parts[1].reshape(b, r), parts[2], parts[3],
                                     parts[4].reshape(b, self.key_blocks)))
        self._key_index = torch.arange(k, device=device)  # [k]
        self.derive()

    def load(self, items: Sequence[TargetRows]) -> None:
        """Fill the buffers for `items` (at most `shape.requests`, each within the shape): a few numpy writes per
        request into one host buffer of ints and one of booleans, then one copy each."""
        r, count = self.shape.rows, len(items)
        host_ints, host_visibility = self._host_sets[self._turn]
        tokens, positions, past, counts, tables = self._host_parts[self._turn]
        self._turn ^= 1
        visibility = host_visibility.numpy()
        host_ints.zero_()
        visibility.fill(False)
        rows = np.fromiter((item.count for item in items), dtype=np.int64, count=count)  # [count]
        live = np.arange(r)[None, :] < rows[:, None]  # [count, r]
        tokens[:count][live] = torch.cat([item.tokens for item in items]).numpy()
        positions[:count][live] = torch.cat([item.positions for item in items]).numpy()
        past[:count] = np.fromiter((item.table.length for item in items), dtype=np.int64, count=count)
        counts[:count] = rows
        visibility[:count] = _LOWER[None, :r, :r] & live[:, :, None] & live[:, None, :]  # causal among real rows
        for index, item in enumerate(items):
            blocks = item.table.block_array(self.key_blocks)
            tables[index, : len(blocks)] = blocks
            if item.visibility is not None:  # a tree: its ancestor mask
                n = int(rows[index])
                visibility[index, :n, :n] = item.visibility.numpy()
        self._ints.copy_(host_ints, non_blocking=True)
        self.visibility.copy_(host_visibility, non_blocking=True)

    def load_row(self, index: int, item: TargetRows) -> None:
        """Fill request `index`'s part of the buffers alone, the other requests' untouched (their inputs may be what
        the device left there: a request joining a chain of device rounds), queued without a wait."""
        r, n, kb = self.shape.rows, item.count, self.key_blocks
        ints = np.zeros(2 * r + 2 + kb, dtype=np.int64)  # tokens [r], positions [r], past, count, block table [kb]
        ints[:n] = item.tokens.numpy()
        ints[r : r + n] = item.positions.numpy()
        ints[2 * r], ints[2 * r + 1] = item.table.length, n
        blocks = item.table.block_array(kb)
        ints[2 * r + 2 : 2 * r + 2 + len(blocks)] = blocks
        visibility = np.zeros((r, r), dtype=np.bool_)
        visibility[:n, :n] = item.visibility.numpy() if item.visibility is not None else _LOWER[:n, :n]
        on = to_device(torch.from_numpy(ints), self._ints.device)
        self.tokens[index].copy_(on[:r])
        self.positions[index].copy_(on[r : 2 * r])
        self.past[index : index + 1].copy_(on[2 * r : 2 * r + 1])
        self.counts[index : index + 1].copy_(on[2 * r + 1 : 2 * r + 2])
        self.blocks[index].copy_(on[2 * r + 2 :])
        self.visibility[index].copy_(to_device(torch.from_numpy(visibility), self._ints.device))

    def derive(self) -> None:
        """Slots from the loaded buffers, on the device:

        * `read_slots` [b, k]: the slot of each request's key positions 0 .. past + rows - 1, the trash slot after;
        * `write_slots` [b * r]: the slot of each real row (position past + row), the trash slot for padding rows;
          `store_slots` the same with -1 for padding rows (the fused kernels store nothing there).

        The masks (`full_mask`, `sliding_mask`) are derived when a pass first reads them after this: the paged
        attention program reads the slots and visibility instead, and its passes never build them."""
        b, r, k = self.shape.requests, self.shape.rows, self.shape.keys
        size, trash = self.pool.block_size, self.pool.trash_slot
        keys = self._key_index  # [k]
        past, counts = self.past[:, None], self.counts[:, None]  # [b, 1]
        last_block = self.key_blocks - 1
        key_slots = self.blocks.gather(1, (keys // size)[None].expand(b, k)) * size + keys % size  # [b, k]
        self.read_slots = torch.where(keys[None] < past + counts, key_slots, trash)  # [b, k]
        row_index = keys[:r][None]  # [1, r]
        row_keys = past + row_index  # [b, r]: each row's own position
        row_blocks = self.blocks.gather(1, (row_keys // size).clamp(max=last_block))  # [b, r]
        real = row_index < counts  # [b, r]
        write = torch.where(real, row_blocks * size + row_keys % size, trash)  # [b, r]
        self.write_slots = write.reshape(-1)  # [b * r]
        self.store_slots = torch.where(real, write, -1).reshape(-1)  # [b * r]
        self._masks: tuple[torch.Tensor, torch.Tensor | None] | None = None

    @property
    def full_mask(self) -> torch.Tensor:
        """[b, 1, r, k] bool: a real row sees the committed keys and its new rows by `visibility`; every row sees key
        0 (padding rows read one finite slot, so that nothing turns NaN)."""
        return self._derived_masks()[0]

    @property
    def sliding_mask(self) -> torch.Tensor | None:
        """The same within the window (by position), where the model has sliding layers."""
        return self._derived_masks()[1]

    def _derived_masks(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self._masks is not None:
            return self._masks
        b, r, k = self.shape.requests, self.shape.rows, self.shape.keys
        keys = self._key_index  # [k]
        past, counts = self.past[:, None], self.counts[:, None]  # [b, 1]
        relative = keys[None] - past  # [b, k]: key position minus the first new row's
        new_row = relative.clamp(0, r - 1)  # [b, k]
        among_new = self.visibility.gather(2, new_row[:, None, :].expand(b, r, k))  # [b, r, k]
        full = (relative < 0)[:, None, :] | (among_new & ((relative >= 0) & (relative < counts))[:, None, :])
        full[..., 0] = True
        sliding_mask = None
        if self.window is not None:
            new_positions = self.positions.gather(1, new_row)  # [b, k]
            key_positions = torch.where(relative < 0, keys[None], new_positions)  # [b, k]
            distance = self.positions[:, :, None] - key_positions[:, None, :]  # [b, r, k]
            sliding = full & (distance < self.window)
            sliding[..., 0] |= ~sliding.any(-1)  # a padded row keeps its finite slot
            sliding_mask = sliding[:, None]
        self._masks = (full[:, None], sliding_mask)
        return self._masks

    def last_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [requests, rows, H] -> each request's last real row [requests, 1, H] (row 0 for padding requests)."""
        requests = rows.shape[0]
        last = (self.counts - 1).clamp(min=0)  # [requests]
        return rows[torch.arange(requests, device=rows.device), last][:, None]

    def additive_mask(self, dtype: torch.dtype) -> torch.Tensor:
        """The full-attention mask as additive float [requests, 1, rows, keys] (0 visible, -inf hidden)."""
        zeros = torch.zeros(self.full_mask.shape, dtype=dtype, device=self.full_mask.device)
        return zeros.masked_fill_(~self.full_mask, float("-inf"))


class PaddedAttention:
    """`AttentionBackend` of a padded batch: scatter the new K/V, then attend over the pool read in place
    (`dflash.kernels.triton_paged_attention`, on CUDA) or gather each request's keys for one masked SDPA (on the
    CPU, in sliding-window layers, or with DFLASH_PADDED_ATTENTION=gather)."""

    def __init__(self, pool: BlockPool, batch: PaddedBatch, sliding: Sequence[bool]) -> None:
        self.pool, self.batch, self.sliding = pool, batch, list(sliding)
        self.in_place = pool.keys.is_contiguous() and paged_attention_usable(pool.device, pool.keys.shape[-1])

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """q: [requests, heads, rows, head_dim]; k, v: [requests, kv_heads, rows, head_dim] -> [requests, rows,
        heads * head_dim]."""
        keys, values = self.pool.keys[layer], self.pool.values[layer]  # [kv_heads, slots, head_dim]
        b, kv_heads, rows, dim = k.shape
        keys.index_copy_(1, self.batch.write_slots, k.transpose(0, 1).reshape(kv_heads, b * rows, dim))
        values.index_copy_(1, self.batch.write_slots, v.transpose(0, 1).reshape(kv_heads, b * rows, dim))
        read = self.batch.read_slots  # [requests, keys]
        sliding = layer < len(self.sliding) and self.sliding[layer]
        if self.in_place and not sliding:
            batch = self.batch
            out = paged_attention(q, keys, values, read, batch.past, batch.counts, batch.visibility, scale)
            return out.transpose(1, 2).reshape(b, rows, -1)  # a view: the program writes [requests, rows, heads, hd]
        gathered_k = keys[:, read].transpose(0, 1)  # [requests, kv_heads, keys, head_dim]
        gathered_v = values[:, read].transpose(0, 1)
        mask = self.batch.sliding_mask if sliding and self.batch.sliding_mask is not None else self.batch.full_mask
        out = F.scaled_dot_product_attention(
            q, gathered_k, gathered_v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != kv_heads
        )
        return out.transpose(1, 2).reshape(b, rows, -1)


def padded_forward(
    model: CausalLM, pool: BlockPool, batch: PaddedBatch, capture: Sequence[int], *, last_rows: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The target pass over a loaded batch -> (logits [requests, rows, vocab], features [requests, rows, F] or
    None). The pool's rows past each table's length are written; nothing is committed. `last_rows`: logits of each
    request's last real row only, [requests, 1, vocab] (a prompt chunk's)."""
    if model.config.is_hybrid:
        raise GenerationError("the padded (CUDA graph) passes keep no linear-attention state: hybrids run packed")
    batch.derive()
    backend = PaddedAttention(pool, batch, model.sliding)
    hidden, features = model.run_layers(batch.tokens, batch.positions, None, None, backend, capture)
    if last_rows:
        hidden = batch.last_rows(hidden)
    logits = model.finish(hidden, None, "all").logits
    assert logits is not None
    return logits, features
