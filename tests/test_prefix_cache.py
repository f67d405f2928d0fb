"""The prefix cache as a data structure: content keys, longest-prefix lookup, partial blocks, LRU under a byte
budget (leaves first), the read-only length forecast (also while another thread writes), stores of a cache cut
short by a cancelled prefill, refusal of inconsistent stores, and restoring blocks into a target cache."""

from __future__ import annotations

import threading

import pytest
import torch

from dflash.kv.cache import KVCache
from dflash.kv.prefix_cache import PrefixCache, block_keys, restore_prefix

BLOCK = 4
LAYERS, HEADS, DIM, FEATURES = 2, 1, 3, 5


def prefilled(tokens: list[int]) -> tuple[KVCache, torch.Tensor]:
    """A target cache holding `tokens` (K/V derived from token and position) and their features."""
    cache = KVCache(LAYERS, HEADS, DIM, len(tokens) + 8)
    ids = torch.tensor(tokens, dtype=torch.float32)
    positions = torch.arange(len(tokens), dtype=torch.float32)
    grid = ids[None, None, :, None] * 100 + positions[None, None, :, None] + torch.arange(DIM)[None, None, None, :]
    cache.keys[:, 0, :, : len(tokens)] = grid  # [layers, heads, len, dim]
    cache.values[:, 0, :, : len(tokens)] = -grid
    cache.length = len(tokens)
    features = (ids[:, None] * 10 + torch.arange(FEATURES))[None]  # [1, len, features]
    return cache, features


def store(pc: PrefixCache, tokens: list[int]) -> int:
    cache, features = prefilled(tokens)
    return pc.store(tokens, cache, features)


def test_keys_name_the_whole_prefix() -> None:
    a = block_keys(list(range(12)), BLOCK, 3)
    b = block_keys([0, 1, 2, 3, 4, 99, *range(6, 12)], BLOCK, 3)  # differs inside block 1
    assert a[0] == b[0] and a[1] != b[1]
    assert a[2] != b[2]  # block 2 has the same tokens but follows a different prefix


def test_lookup_returns_the_longest_cached_prefix_and_never_the_last_token() -> None:
    pc = PrefixCache(1 << 20, BLOCK, feature_layers=(1,))
    tokens = list(range(10, 22))  # three full blocks
    assert store(pc, tokens) == 3
    assert [len(b.tokens) for b in pc.lookup([*tokens, 7, 8], limit=13)] == [BLOCK] * 3
    # the same prompt again: its last token must be recomputed, so only two blocks are usable
    assert len(pc.lookup(tokens, limit=len(tokens) - 1)) == 2
    # shares one block and half of the next: only the full block is reused
    assert len(pc.lookup([*tokens[:6], 1, 2, 3, 4, 5], limit=10)) == 1
    assert pc.lookup([1, *tokens[1:]], limit=11) == []
    stats = pc.stats()
    assert (stats.hits, stats.misses, stats.reused_tokens) == (3, 1, 4 * (3 + 2 + 1))


def test_store_keeps_only_full_blocks_and_adds_nothing_twice() -> None:
    pc = PrefixCache(1 << 20, BLOCK, feature_layers=(1,))
    assert store(pc, list(range(10))) == 2  # 2 full blocks, 2 tokens left over
    assert store(pc, list(range(13))) == 1  # the first two are shared
    assert pc.stats().tokens == 12
    block = pc.lookup(list(range(13)), limit=12)[2]
    assert block.tokens == (8, 9, 10, 11)
    assert block.features is not None and block.features[0, 0].item() == 80


def test_lru_eviction_under_budget_drops_leaves_first() -> None:
    one_block = prefilled(list(range(BLOCK)))[0].keys[:, 0, :, :BLOCK].nbytes * 2 + BLOCK * FEATURES * 4
    pc = PrefixCache(5 * one_block, BLOCK, feature_layers=(1,))
    conv_a, conv_b = list(range(100, 112)), list(range(200, 212))
    store(pc, conv_a)
    store(pc, conv_b)  # 6 blocks > 5: the least recently used leaf (A's last block) goes
    stats = pc.stats()
    assert stats.blocks == 5 and stats.evictions == 1 and stats.bytes <= stats.budget_bytes
    assert len(pc.lookup([*conv_a, 0], limit=12)) == 2  # A lost its deepest block, not its first
    store(pc, [*conv_a[:8], 300, 301, 302, 303])  # A was just used: B's deepest block goes now
    assert len(pc.lookup([*conv_b, 0], limit=12)) == 2
    assert len(pc.lookup([*conv_a, 0], limit=12)) == 2
    # every block left is reachable from the first block of its prompt: nothing stranded
    reachable = len(pc.lookup([*conv_b, 0], limit=12)) + len(pc.lookup([*conv_a[:8], 300, 301, 302, 303, 0], limit=12))
    assert reachable == pc.stats().blocks


def test_cached_length_forecasts_a_lookup_without_touching_anything() -> None:
    one_block = prefilled(list(range(BLOCK)))[0].keys[:, 0, :, :BLOCK].nbytes * 2 + BLOCK * FEATURES * 4
    pc = PrefixCache(5 * one_block, BLOCK, feature_layers=(1,))
    conv_a, conv_b = list(range(100, 112)), list(range(200, 208))
    store(pc, conv_a)
    store(pc, conv_b)  # 5 blocks: full; B is the most recently used
    assert pc.cached_length(conv_a, limit=len(conv_a) - 1) == 2 * BLOCK  # the last block holds the last token
    assert pc.cached_length([*conv_a, 0], limit=12) == 3 * BLOCK
    assert pc.cached_length([*conv_a[:6], 1, 2, 3, 4], limit=9) == BLOCK  # half a block is not reused
    assert pc.cached_length([7, *conv_a[1:]], limit=11) == 0
    assert pc.cached_length(conv_a, limit=0) == 0 and pc.cached_length([], limit=5) == 0
    assert (pc.stats().hits, pc.stats().misses, pc.stats().reused_tokens) == (0, 0, 0)  # no lookup counted
    for _ in range(3):
        pc.cached_length([*conv_a, 0], limit=12)  # would make A the most recent, were it a lookup
    store(pc, list(range(300, 304)))  # one block over budget: A's deepest block is still the least recent leaf
    assert pc.cached_length([*conv_a, 0], limit=12) == 2 * BLOCK
    assert pc.cached_length([*conv_b, 0], limit=8) == 2 * BLOCK


def test_cached_length_is_safe_while_another_thread_stores_and_evicts() -> None:
    one_block = prefilled(list(range(BLOCK)))[0].keys[:, 0, :, :BLOCK].nbytes * 2 + BLOCK * FEATURES * 4
    pc = PrefixCache(4 * one_block, BLOCK, feature_layers=(1,))
    prompts = [list(range(base, base + 4 * BLOCK)) for base in range(0, 4000, 100)]
    seen: list[int] = []
    done = threading.Event()

    def fill() -> None:
        for prompt in prompts:
            store(pc, prompt)
        done.set()

    writer = threading.Thread(target=fill)
    writer.start()
    while not done.is_set():
        seen.extend(pc.cached_length([*prompt, 0], limit=4 * BLOCK) for prompt in prompts[::7])
    writer.join()
    assert seen and all(length % BLOCK == 0 and 0 <= length <= 4 * BLOCK for length in seen)
    assert pc.cached_length([*prompts[-1], 0], limit=4 * BLOCK) == 4 * BLOCK  # the last prompt stored stays whole
    assert pc.stats().evictions > 0


def test_store_of_a_cache_cut_short_keeps_only_the_blocks_it_holds() -> None:
    """A prefill cancelled between chunks leaves cache.length short of the prompt: only blocks within it go in."""
    tokens = list(range(50, 66))  # four blocks
    cache, features = prefilled(tokens)
    cache.length = 2 * BLOCK + 1  # two blocks and one position of the third were prefilled
    pc = PrefixCache(1 << 20, BLOCK, feature_layers=(1,))
    assert pc.store(tokens, cache, features[:, : cache.length]) == 2
    assert pc.cached_length(tokens, limit=len(tokens) - 1) == 2 * BLOCK


def test_zero_budget_keeps_nothing() -> None:
    pc = PrefixCache(0, BLOCK)
    cache, _ = prefilled(list(range(8)))
    pc.store(list(range(8)), cache, None)
    assert pc.stats().blocks == 0 and pc.stats().bytes == 0


def test_store_refuses_features_that_do_not_match_the_configuration() -> None:
    cache, features = prefilled(list(range(8)))
    with pytest.raises(ValueError, match="features"):
        PrefixCache(1 << 20, BLOCK, feature_layers=(1,)).store(list(range(8)), cache, None)
    with pytest.raises(ValueError, match="features"):
        PrefixCache(1 << 20, BLOCK).store(list(range(8)), cache, features)


def test_restore_writes_the_stored_slots_and_positions() -> None:
    tokens = list(range(30, 42))
    source, _ = prefilled(tokens)
    pc = PrefixCache(1 << 20, BLOCK)
    pc.store(tokens, source, None)
    target = KVCache(LAYERS, HEADS, DIM, 32)
    restored = restore_prefix(target, pc.lookup([*tokens, 1], limit=12))
    assert restored == 12 and target.length == 12
    assert torch.equal(target.keys[:, :, :, :12], source.keys[:, :, :, :12])
    assert torch.equal(target.values[:, :, :, :12], source.values[:, :, :, :12])
    assert target.positions[0, :12].tolist() == list(range(12))
    with pytest.raises(ValueError, match="empty"):
        restore_prefix(target, [])
