"""Prompt prefill through the prefix cache: restore the longest cached prefix, prefill the rest, store the new blocks.

Used by plain and speculative decoding alike. A hit leaves the target cache and the features exactly as a cold
chunked prefill would (see `dflash.kv.prefix_cache` for why), and at least the last prompt token always goes
through the target, because its logits choose the first generated token.

A prefill cancelled between chunks still stores the full blocks its completed chunks cover: they end on the cold
prefill's chunk grid, so they are exactly what a completed prefill would have stored. A client that gives up on a
long prompt and sends it again then resumes where the first attempt stopped instead of starting over. A prefill
that fails (raises) stores nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from dflash.generation.forwards import Forwards
from dflash.generation.prefill import FeatureSink, chunked_prefill
from dflash.kv.cache import KVCache
from dflash.kv.prefix_cache import CachedBlock, PrefixCache, restorable, restore_prefix
from dflash.models.model import CausalLM


@dataclass
class PromptPrefill:
    logits: torch.Tensor  # [1, vocab] at the last prompt position
    features: torch.Tensor | None  # [1, prompt, n*hidden] when `capture` asked for them
    cached_tokens: int  # prompt positions restored from the prefix cache


def prefix_cache_usable(prefix_cache: PrefixCache | None, chunk: int, capture: Sequence[int]) -> bool:
    """The cache can serve this prefill: its blocks end on chunk boundaries and it stores the features asked for."""
    if prefix_cache is None or prefix_cache.block_tokens % max(1, chunk):
        return False
    return not capture or tuple(capture) == prefix_cache.feature_layers


def cached_prefix_length(
    prefix_cache: PrefixCache | None, token_ids: Sequence[int], *, chunk: int, capture: Sequence[int] = ()
) -> int:
    """Prompt positions `prefill_prompt` would restore for `token_ids` now (0 when the cache cannot serve it).

    Read-only: it neither marks blocks used nor counts a hit or miss. The generation thread may insert or evict
    blocks before the prompt is prefilled, so this is a forecast; the prefill's `cached_tokens` is the fact."""
    if not prefix_cache_usable(prefix_cache, chunk, capture) or not token_ids:
        return 0
    assert prefix_cache is not None
    return prefix_cache.cached_length(token_ids, limit=_restorable(token_ids))


def _restorable(token_ids: Sequence[int]) -> int:
    """How many leading prompt tokens may come from the cache: all but the last, whose logits must be computed."""
    return len(token_ids) - 1


def prefill_prompt(
    model: CausalLM,
    cache: KVCache,
    prompt: torch.Tensor,
    *,
    chunk: int,
    capture: Sequence[int] = (),
    should_stop: Callable[[], bool] | None = None,
    prefix_cache: PrefixCache | None = None,
    forwards: Forwards | None = None,
    on_features: FeatureSink | None = None,
) -> PromptPrefill | None:
    """prompt: [1, length] into an empty `cache`. Returns None when `should_stop` abandoned the prefill (after
    storing the full blocks of the chunks it completed). `forwards` runs the model (`chunked_prefill`). A hybrid
    model's linear-attention state is kept at every block boundary while it prefills, stored with the blocks and
    restored from the deepest reused one. Without a usable prefix cache, `on_features` takes each chunk's
    features (`chunked_prefill`) and the result's features are None; a prefix cache stores them, and they come
    back whole."""
    if not prefix_cache_usable(prefix_cache, chunk, capture):
        logits, captured = chunked_prefill(
            model, cache, prompt, chunk=chunk, capture=capture, should_stop=should_stop, forwards=forwards,
            on_features=on_features,
        )
        return None if logits is None else PromptPrefill(logits, captured, 0)
    assert prefix_cache is not None
    token_ids = prompt[0].tolist()
    blocks = restorable(prefix_cache.lookup(token_ids, limit=_restorable(token_ids)), cache.recurrent is not None)
    reused = restore_prefix(cache, blocks)
    if cache.recurrent is not None:
        cache.recurrent.checkpoint_every = prefix_cache.block_tokens
    try:
        return _prefill_and_store(
            model, cache, prompt, blocks, reused, prefix_cache, chunk, capture, should_stop, forwards
        )
    finally:
        if cache.recurrent is not None:  # decoding rows may be rolled back: no snapshots of them
            cache.recurrent.checkpoint_every = 0
            cache.recurrent.checkpoints = {}


def _prefill_and_store(
    model: CausalLM,
    cache: KVCache,
    prompt: torch.Tensor,
    blocks: list[CachedBlock],
    reused: int,
    prefix_cache: PrefixCache,
    chunk: int,
    capture: Sequence[int],
    should_stop: Callable[[], bool] | None,
    forwards: Forwards | None,
) -> PromptPrefill | None:
    """The rest of `prefill_prompt` after `blocks` restored `reused` positions."""
    token_ids = prompt[0].tolist()
    layers = prefix_cache.feature_layers
    logits, suffix_features = chunked_prefill(
        model, cache, prompt[:, reused:], chunk=chunk, capture=layers, should_stop=should_stop, forwards=forwards
    )  # [1, vocab] or None when cancelled; [1, positions prefilled, n*hidden] or None without layers
    features: torch.Tensor | None = None
    if layers:
        cached = [block.features for block in blocks if block.features is not None]  # each [block, n*hidden]
        parts = [torch.cat(cached)[None]] if cached else []
        if suffix_features is not None:
            parts.append(suffix_features)
        features = torch.cat(parts, dim=1) if parts else None  # [1, cache.length, n*hidden]
    if logits is None:  # cancelled: keep what the completed chunks computed, for the resend
        if cache.length >= reused + prefix_cache.block_tokens:  # at least one new full block
            prefix_cache.store(token_ids, cache, features)  # only blocks that end within cache.length
        return None
    prefix_cache.store(token_ids, cache, features)
    return PromptPrefill(logits, features if capture else None, reused)
