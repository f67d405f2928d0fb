"""Static KV cache written by index, with crop and compact for speculative rollback.

One tensor pair holds every layer: `keys`/`values` are [layers, batch, kv_heads, capacity, head_dim] (the largest
of the layers' head counts and widths, when they differ: a layer uses the first heads and lanes). Each slot
also records the RoPE position of the token stored there (`positions`, [batch, capacity]), so attention masks are
built from positions: this lets tree verification place sibling nodes at the same position in different slots.
All rows of a batch share one `length` (the number of valid slots).

Models with linear-attention layers attach their per-sequence recurrent state (`recurrent`, see
`dflash.kv.recurrent`): it advances and crops with the slots, so a rollback never leaves a rejected row's effect.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from dflash.errors import GenerationError

if TYPE_CHECKING:
    from dflash.kv.recurrent import RecurrentStates


class CacheShape(Protocol):
    @property
    def num_layers(self) -> int: ...

    @property
    def num_kv_heads(self) -> int: ...

    @property
    def head_dim(self) -> int: ...


class CacheWriter(Protocol):
    """What an attention layer needs of a cache: store its new K/V, get back every slot a query may read."""

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


@runtime_checkable
class AttentionBackend(Protocol):
    """Takes over a layer's attention entirely: stores the new K/V where it keeps them and attends each query row
    to the keys it may see (the batched engine core, `dflash.batch.attention`, over its paged pool).

    q: [1, heads, rows, head_dim]; k, v: [1, kv_heads, rows, head_dim] (rotated) -> [1, rows, heads * head_dim]."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor: ...


@dataclass(frozen=True)
class PackedRows:
    """How an attention backend over a pool stores and attends a packed forward's rows, for the native decoder
    layers (`dflash.models.native_stack`): every layer stores row i's K/V at pool slot `write_slots[i]`, then each
    segment's rows [start, start + count) attend to the pool slots `read_slots` under `mask` (bool [count, keys],
    None: every key visible)."""

    keys: torch.Tensor  # [layers, kv_heads, slots, head_dim]
    values: torch.Tensor
    write_slots: torch.Tensor  # int64 [rows]
    segments: list[tuple[int, int, torch.Tensor, torch.Tensor | None]]  # (start, count, read_slots, mask)


class KVCache:
    """Pre-allocated cache; slots [0, length) are committed, the rest is scratch."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        capacity: int,
        *,
        batch: int = 1,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (num_layers, batch, num_kv_heads, capacity, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.positions = torch.zeros((batch, capacity), dtype=torch.long, device=device)
        self.capacity = capacity
        self.length = 0
        self.recurrent: RecurrentStates | None = None  # linear-attention layers' state, when the model has some

    @classmethod
    def matching(cls, config: CacheShape, capacity: int, like: torch.Tensor, batch: int = 1) -> KVCache:
        """A cache shaped for a model `config`, on the dtype and device of `like`."""
        return cls(
            config.num_layers,
            config.num_kv_heads,
            config.head_dim,
            capacity,
            batch=batch,
            dtype=like.dtype,
            device=like.device,
        )

    @classmethod
    def view_of(cls, storage: KVCache, capacity: int) -> KVCache:
        """An empty cache over the first `capacity` slots of `storage` (same memory: CUDA graphs captured on
        `storage` stay valid for it)."""
        if capacity > storage.capacity:
            raise ValueError(f"a view of {capacity} slots does not fit a storage of {storage.capacity}")
        view = cls.__new__(cls)
        view.keys = storage.keys[:, :, :, :capacity]
        view.values = storage.values[:, :, :, :capacity]
        view.positions = storage.positions[:, :capacity]
        view.capacity = capacity
        view.length = 0
        view.recurrent = storage.recurrent  # the same state buffers, emptied
        if view.recurrent is not None:
            view.recurrent.reset()
        return view

    def shares_memory_with(self, storage: KVCache) -> bool:
        return self.keys.data_ptr() == storage.keys.data_ptr() and self.values.data_ptr() == storage.values.data_ptr()

    @property
    def batch(self) -> int:
        return int(self.keys.shape[1])

    def reserve(self, new_tokens: int) -> None:
        """Check that `new_tokens` more slots fit (called before a forward writes them)."""
        if self.length + new_tokens > self.capacity:
            raise GenerationError(
                f"KV cache full: {self.length} + {new_tokens} tokens exceed its capacity of {self.capacity}"
            )
        if self.recurrent is not None:
            self.recurrent.settle()

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store new K/V after the committed slots; return views over every slot a query may read.

        keys/values: [batch, kv_heads, new, head_dim] -> returned views: [batch, kv_heads, length + new, head_dim]
        A layer with fewer heads or narrower heads than the cache (Gemma 4) uses the first of each.
        """
        end = self.length + keys.shape[2]
        heads, width = keys.shape[1], keys.shape[3]
        self.keys[layer, :, :heads, self.length : end, :width] = keys
        self.values[layer, :, :heads, self.length : end, :width] = values
        return self.keys[layer, :, :heads, :end, :width], self.values[layer, :, :heads, :end, :width]

    def write_positions(self, positions: torch.Tensor) -> torch.Tensor:
        """Record the positions of the new tokens; return key positions [batch, length + new]."""
        end = self.length + positions.shape[1]
        self.positions[:, self.length : end] = positions
        return self.positions[:, :end]

    def advance(self, new_tokens: int) -> None:
        self.length += new_tokens
        if self.recurrent is not None:
            self.recurrent.advance(new_tokens)

    def crop(self, length: int) -> None:
        """Forget every slot from `length` on (rejected draft tokens)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot crop a cache of length {self.length} to {length}")
        if self.recurrent is not None:
            self.recurrent.crop(length)
        self.length = length

    def compact(self, start: int, keep_slots: torch.Tensor) -> None:
        """Move the slots `keep_slots` (ascending, all >= start) to start, start+1, ... and crop after them.

        Used after tree verification: the accepted path's rows become contiguous after the committed prefix.
        """
        count = int(keep_slots.numel())
        if self.recurrent is not None:  # the path's rows replayed into the linear-attention state
            self.recurrent.keep(start, [int(slot) for slot in keep_slots.tolist()])
        if count:
            dest = slice(start, start + count)
            self.keys[:, :, :, dest] = self.keys[:, :, :, keep_slots]
            self.values[:, :, :, dest] = self.values[:, :, :, keep_slots]
            self.positions[:, dest] = self.positions[:, keep_slots]
        self.length = start + count
