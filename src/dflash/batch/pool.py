"""Paged K/V memory: one pool of fixed-size blocks per model, shared by every request, and each request's table.

A pool holds `keys`/`values` [layers, kv_heads, slots, head_dim] with slots = blocks x block_size. A request owns a
list of blocks (`SlotTable`); its position p lives at slot `blocks[p // block_size] * block_size + p % block_size`.
Requests of different lengths therefore share one allocation, and a finished request returns its blocks at once.
Blocks carry reference counts so that one block can later be read by several requests (shared prompt prefixes).

Only positions [0, length) of a table are committed; rows written past them (draft blocks, tree nodes) are scratch
that the next step overwrites, so rejecting drafts is `crop` and keeping a tree path is `compact`.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import numpy as np
import torch

from dflash.errors import GenerationError
from dflash.host_copies import to_device

if TYPE_CHECKING:
    from dflash.kv.recurrent import RecurrentStates


class PoolExhausted(GenerationError):
    """The pool has fewer free blocks than asked for."""


class BlockPool:
    """Fixed-size blocks of K/V slots for one model (target or drafter)."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("a pool needs at least one block of at least one slot")
        # one slot past the blocks is the trash slot: fixed-shape passes send their padding rows' K/V there
        shape = (num_layers, num_kv_heads, num_blocks * block_size + 1, head_dim)
        # uninitialised: a slot is always written before it is read, and untouched pages cost no memory on the CPU
        self.keys = torch.empty(shape, dtype=dtype, device=device)
        self.values = torch.empty(shape, dtype=dtype, device=device)
        self.trash_slot = num_blocks * block_size
        self.keys[:, :, self.trash_slot].zero_()  # read (masked) by padding rows: it must hold finite values
        self.values[:, :, self.trash_slot].zero_()
        self.block_size = block_size
        self.num_blocks = num_blocks
        self._refs = [0] * num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: low block numbers are handed out first
        self._lock = threading.Lock()

    @property
    def device(self) -> torch.device:
        return self.keys.device

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    def blocks_for(self, positions: int) -> int:
        return -(-positions // self.block_size)

    def allocate(self, count: int) -> list[int]:
        with self._lock:
            if count > len(self._free):
                raise PoolExhausted(f"the K/V pool has {len(self._free)} free blocks, {count} needed")
            taken = [self._free.pop() for _ in range(count)]
            for block in taken:
                self._refs[block] = 1
            return taken

    def retain(self, blocks: list[int]) -> None:
        with self._lock:
            for block in blocks:
                if self._refs[block] < 1:
                    raise ValueError(f"block {block} is not allocated")
                self._refs[block] += 1

    def release(self, blocks: list[int]) -> None:
        with self._lock:
            for block in blocks:
                if self._refs[block] < 1:
                    raise ValueError(f"block {block} released more often than allocated")
                self._refs[block] -= 1
                if self._refs[block] == 0:
                    self._free.append(block)


class SlotTable:
    """One request's blocks in a pool: where each of its positions is stored, and how many are committed."""

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.blocks: list[int] = []
        self.length = 0  # committed positions
        # a hybrid model's linear-attention state for this request: advanced by the target pass, cropped with the
        # table (a rejected draft's effect is undone where the table forgets its slots)
        self.recurrent: RecurrentStates | None = None
        self._block_array = np.zeros(0, dtype=np.int64)  # `blocks` as an array (fixed-shape passes read it)
        self._slots = torch.empty(0, dtype=torch.long, device=pool.device)  # [capacity]: slot of each position

    @property
    def capacity(self) -> int:
        return len(self.blocks) * self.pool.block_size

    def reserve(self, positions: int) -> None:
        """Own blocks for positions [0, positions): allocates the missing ones (`PoolExhausted` if it cannot)."""
        missing = self.pool.blocks_for(positions) - len(self.blocks)
        if missing <= 0:
            return
        new = self.pool.allocate(missing)
        self.blocks.extend(new)
        self._block_array = np.array(self.blocks, dtype=np.int64)
        size = self.pool.block_size
        starts = torch.tensor(new, dtype=torch.long) * size  # [missing]
        added = (starts[:, None] + torch.arange(size)[None]).reshape(-1)  # [missing * size]
        # queued, not waited for: the GPU may be running a launched-ahead round (`dflash.host_copies`)
        self._slots = torch.cat((self._slots, to_device(added, self.pool.device)))

    def block_array(self, limit: int) -> np.ndarray:
        """The first `limit` (at most) blocks as int64 [<= limit] (a view: do not modify)."""
        return self._block_array[:limit]

    def slots(self, start: int, end: int) -> torch.Tensor:
        """Slots of positions [start, end): int64 [end - start] (a view: do not modify)."""
        if end > self.capacity:
            raise GenerationError(f"positions up to {end} exceed the {self.capacity} reserved")
        return self._slots[start:end]

    def crop(self, length: int) -> None:
        """Keep positions [0, length) committed (rejected drafts after them are forgotten)."""
        if not 0 <= length <= self.capacity:
            raise ValueError(f"cannot set a table of capacity {self.capacity} to length {length}")
        if self.recurrent is not None:
            self.recurrent.crop(length)
        self.length = length

    def compact(self, start: int, keep: torch.Tensor) -> None:
        """Move the rows at positions `keep` (ascending, all >= start) to start, start+1, ... in every layer, and
        commit up to them (a tree's accepted path after verification). A linear-attention state replays that
        path's rows from the state before the tree (`RecurrentStates.keep`, as `KVCache.compact` does)."""
        if self.recurrent is not None:
            self.recurrent.keep(start, [int(position) for position in keep.tolist()])
        count = int(keep.numel())
        if count:
            dest = self._slots[start : start + count]
            source = self._slots[keep.to(self._slots.device)]
            for storage in (self.pool.keys, self.pool.values):
                storage[:, :, dest] = storage[:, :, source]  # the gather copies before the scatter writes
        self.length = start + count

    def release(self) -> None:
        """Give every block back (the table is empty afterwards)."""
        if self.blocks:
            self.pool.release(self.blocks)
        self.blocks = []
        self._block_array = self._block_array[:0]
        self.length = 0
        if self.recurrent is not None:
            self.recurrent.reset()
        self._slots = self._slots[:0]
