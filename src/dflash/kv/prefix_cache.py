"""Prefix cache: target K/V and drafter features of prompt prefixes, reused by later prompts that start the same way.

Keying. A prompt is cut into blocks of `block_tokens` tokens; block i is keyed by a digest of block i-1's key and
its own tokens, so a key names the whole prefix up to the block's end and any shared prefix hits, whatever chat
template produced it. Only full blocks are cached; a prompt that shares part of a block reuses the blocks before it.

What a block holds, for each of its positions: the target's K/V of every layer and, when the engine has a
drafter, the target features the drafter reads (the captured layer outputs). For a hybrid model (linear-attention
layers) it also holds those layers' state after its last position (`dflash.kv.recurrent`), which a hit restores
from its deepest block; a prefix whose blocks lack it is not restored. The drafter's own context K/V is
not stored: it is a per-position function of the features, recomputed on the first draft exactly as after a
cold prefill.

Exactness. Blocks are only written from completed prefill chunks (a whole prefill, or the chunks a cancelled
one finished), and `block_tokens` is a multiple of the prefill chunk, so a hit ends on a chunk boundary of the
cold prefill: the remaining suffix is prefilled in the same
chunks, over the same K/V, as a cold run would, and the restored state equals the cold one.

Eviction. Least recently used, whole blocks, under a byte budget. A lookup or store touches its chain from the
deepest block to the first, so a block is never more recently used than its parent: the least recently used
block is always a leaf and evicting it never strands a descendant.
"""

from __future__ import annotations

import hashlib
import threading
from array import array
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from dflash.kv.cache import KVCache
from dflash.kv.recurrent import RecurrentSnapshot

_ROOT = b"dflash-prefix-cache-v1"


@dataclass(frozen=True)
class CachedBlock:
    key: bytes
    tokens: tuple[int, ...]
    keys: torch.Tensor  # [layers, kv_heads, block, head_dim]
    values: torch.Tensor  # [layers, kv_heads, block, head_dim]
    features: torch.Tensor | None  # [block, n*hidden], None when the engine has no drafter
    recurrent: RecurrentSnapshot | None = None  # a hybrid's linear-attention state after the block's last position

    @property
    def nbytes(self) -> int:
        total = self.keys.nbytes + self.values.nbytes + (self.recurrent.nbytes if self.recurrent is not None else 0)
        return total + (self.features.nbytes if self.features is not None else 0)


@dataclass(frozen=True)
class PrefixCacheStats:
    hits: int  # lookups that reused at least one block
    misses: int  # lookups that reused nothing
    evictions: int  # blocks evicted to stay under the budget
    reused_tokens: int  # prompt tokens served from the cache, over all lookups
    blocks: int  # blocks held now
    tokens: int  # positions held now
    bytes: int  # bytes held now
    budget_bytes: int
    block_tokens: int


def block_keys(token_ids: Sequence[int], block_tokens: int, count: int) -> list[bytes]:
    """Keys of the first `count` full blocks of `token_ids` (each names its whole prefix)."""
    keys: list[bytes] = []
    parent = _ROOT
    for index in range(count):
        tokens = array("q", token_ids[index * block_tokens : (index + 1) * block_tokens])
        parent = hashlib.blake2b(parent + tokens.tobytes(), digest_size=16).digest()
        keys.append(parent)
    return keys


class PrefixCache:
    """Blocks of cached prefixes under a byte budget; safe to read statistics from another thread."""

    def __init__(self, budget_bytes: int, block_tokens: int, feature_layers: Sequence[int] = ()) -> None:
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be at least 1, got {block_tokens}")
        self.budget_bytes = budget_bytes
        self.block_tokens = block_tokens
        self.feature_layers = tuple(feature_layers)  # target layers whose outputs are stored (the drafter's)
        self._blocks: OrderedDict[bytes, CachedBlock] = OrderedDict()  # least recently used first
        self._bytes = 0
        self._hits = self._misses = self._evictions = self._reused = 0
        self._lock = threading.Lock()

    # ---- reading -----------------------------------------------------------------------------------------
    def lookup(self, token_ids: Sequence[int], *, limit: int) -> list[CachedBlock]:
        """The longest chain of cached blocks that prefixes `token_ids[:limit]`, first block first."""
        with self._lock:
            found = self._chain(token_ids, limit)
            self._touch(found)
            if found:
                self._hits += 1
                self._reused += len(found) * self.block_tokens
            else:
                self._misses += 1
            return found

    def cached_length(self, token_ids: Sequence[int], *, limit: int) -> int:
        """Positions `lookup(token_ids, limit=limit)` would return now, without marking blocks used or counting a
        hit or miss (a forecast for another thread: the generation thread may insert or evict before it looks)."""
        with self._lock:
            return len(self._chain(token_ids, limit)) * self.block_tokens

    def stats(self) -> PrefixCacheStats:
        with self._lock:
            return PrefixCacheStats(
                hits=self._hits, misses=self._misses, evictions=self._evictions, reused_tokens=self._reused,
                blocks=len(self._blocks), tokens=len(self._blocks) * self.block_tokens, bytes=self._bytes,
                budget_bytes=self.budget_bytes, block_tokens=self.block_tokens,
            )

    # ---- writing -----------------------------------------------------------------------------------------
    def store(self, token_ids: Sequence[int], cache: KVCache, features: torch.Tensor | None) -> int:
        """Keep every full block of `token_ids` that the cache holds; returns the number of new blocks.

        cache: the target cache after a prefill of `token_ids`, whole or cancelled between chunks (slots
        0 .. cache.length-1 hold the prompt's first positions, batch 1); features: [1, cache.length or more,
        n*hidden] captured at `feature_layers` (None when there are none)."""
        if cache.batch != 1:
            raise ValueError("the prefix cache stores batch-1 caches only")
        length = cache.length
        recurrent = cache.recurrent.checkpoints if cache.recurrent is not None else None
        keys, values = cache.keys[:, 0, :, :length], cache.values[:, 0, :, :length]
        return self.store_rows(token_ids, keys, values, features, recurrent=recurrent)

    def store_rows(
        self,
        token_ids: Sequence[int],
        keys: torch.Tensor,
        values: torch.Tensor,
        features: torch.Tensor | None,
        *,
        recurrent: Mapping[int, RecurrentSnapshot] | None = None,
    ) -> int:
        """`store` from the K/V of the first positions of `token_ids`: keys/values [layers, kv_heads, length,
        head_dim] (any storage: the blocks are copied), features [1, length or more, n*hidden] or None. A hybrid
        model gives its linear-attention states by position (`RecurrentStates.checkpoints`): blocks are stored up
        to the first whose end has none."""
        if bool(self.feature_layers) != (features is not None):
            raise ValueError("features must be given exactly when the cache stores feature layers")
        count = min(len(token_ids), keys.shape[2]) // self.block_tokens
        digests = block_keys(token_ids, self.block_tokens, count)
        with self._lock:
            chain: list[CachedBlock] = []
            added = 0
            for index, key in enumerate(digests):
                block = self._blocks.get(key)
                if block is None:
                    end = (index + 1) * self.block_tokens
                    if recurrent is not None and end not in recurrent:
                        break  # a hybrid block without its state could not be resumed from, nor could its children
                    state = recurrent[end] if recurrent is not None else None
                    block = self._copy_block(key, token_ids, keys, values, features, index, state)
                    self._blocks[key] = block
                    self._bytes += block.nbytes
                    added += 1
                chain.append(block)
            self._touch(chain)
            self._evict_to(self.budget_bytes)
            return added

    def clear(self) -> None:
        with self._lock:
            self._blocks.clear()
            self._bytes = 0

    # ---- internals ---------------------------------------------------------------------------------------
    def _copy_block(
        self, key: bytes, token_ids: Sequence[int], keys: torch.Tensor, values: torch.Tensor,
        features: torch.Tensor | None, index: int, recurrent: RecurrentSnapshot | None,
    ) -> CachedBlock:
        lo, hi = index * self.block_tokens, (index + 1) * self.block_tokens
        return CachedBlock(
            key=key,
            tokens=tuple(token_ids[lo:hi]),
            keys=keys[:, :, lo:hi].clone(),  # [layers, kv_heads, block, head_dim]
            values=values[:, :, lo:hi].clone(),
            features=features[0, lo:hi].clone() if features is not None else None,  # [block, n*hidden]
            recurrent=recurrent,
        )

    def _chain(self, token_ids: Sequence[int], limit: int) -> list[CachedBlock]:
        """The cached blocks that prefix `token_ids[:limit]`, first block first (the caller holds the lock)."""
        found: list[CachedBlock] = []
        count = min(limit, len(token_ids)) // self.block_tokens
        for index, key in enumerate(block_keys(token_ids, self.block_tokens, count)):
            block = self._blocks.get(key)
            lo = index * self.block_tokens
            if block is None or block.tokens != tuple(token_ids[lo : lo + self.block_tokens]):
                break
            found.append(block)
        return found

    def _touch(self, chain: list[CachedBlock]) -> None:
        """Mark a chain used, deepest block first, so every parent ends up more recent than its children."""
        for block in reversed(chain):
            self._blocks.move_to_end(block.key)

    def _evict_to(self, budget: int) -> None:
        while self._blocks and self._bytes > budget:
            _, block = self._blocks.popitem(last=False)
            self._bytes -= block.nbytes
            self._evictions += 1


def restorable(blocks: Sequence[CachedBlock], hybrid: bool) -> list[CachedBlock]:
    """The blocks of a lookup a model can resume from: all of them, or for a hybrid model (linear-attention state)
    the longest chain that ends in a block holding that state."""
    chain = list(blocks)
    if hybrid:
        while chain and chain[-1].recurrent is None:
            chain.pop()
    return chain


def restore_prefix(cache: KVCache, blocks: Sequence[CachedBlock]) -> int:
    """Write cached blocks into an empty batch-1 target cache at slots 0..; returns the positions restored. A
    hybrid model's cache also takes the linear-attention state of the last block (`restorable` blocks only)."""
    if cache.length != 0 or cache.batch != 1:
        raise ValueError("restore_prefix needs an empty batch-1 cache")
    if cache.recurrent is not None and blocks and blocks[-1].recurrent is None:
        raise ValueError("the last block holds no linear-attention state to resume from")
    start = 0
    for block in blocks:
        end = start + len(block.tokens)
        cache.keys[:, 0, :, start:end] = block.keys
        cache.values[:, 0, :, start:end] = block.values
        start = end
    cache.positions[:, :start] = torch.arange(start, device=cache.positions.device)
    last = blocks[-1].recurrent if blocks else None
    if cache.recurrent is not None and last is not None:
        cache.recurrent.restore(last, start)
    cache.length = start
    return start
