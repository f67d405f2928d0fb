"""Prompt prefill through the prefix cache: restore the longest cached prefix, prefill the rest, store the new blocks.

Used by plain and speculative decoding alike. A hit leaves the target cache and the features exactly as a cold
chunked prefill would (see `dflash.kv.prefix_cache` for why), and at least the last prompt token always goes
through the target, because its logits choose the first generated token. Blocks are stored only after the whole
prefill completed: a prefill cancelled between chunks (or failing) leaves nothing behind.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from dflash.generation.prefill import chunked_prefill
from dflash.kv.cache import KVCache
from dflash.kv.prefix_cache import PrefixCache, restore_prefix
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


def prefill_prompt(
    model: CausalLM,
    cache: KVCache,
    prompt: torch.Tensor,
    *,
    chunk: int,
    capture: Sequence[int] = (),
    should_stop: Callable[[], bool] | None = None,
    prefix_cache: PrefixCache | None = None,
) -> PromptPrefill | None:
    """prompt: [1, length] into an empty `cache`. Returns None when `should_stop` abandoned the prefill."""
    if not prefix_cache_usable(prefix_cache, chunk, capture):
        logits, captured = chunked_prefill(model, cache, prompt, chunk=chunk, capture=capture, should_stop=should_stop)
        return None if logits is None else PromptPrefill(logits, captured, 0)
    assert prefix_cache is not None
    token_ids = prompt[0].tolist()
    blocks = prefix_cache.lookup(token_ids, limit=len(token_ids) - 1)  # the last token must run for its logits
    reused = restore_prefix(cache, blocks)
    layers = prefix_cache.feature_layers
    logits, suffix_features = chunked_prefill(
        model, cache, prompt[:, reused:], chunk=chunk, capture=layers, should_stop=should_stop
    )  # [1, vocab], [1, length - reused, n*hidden] or None
    if logits is None:
        return None
    features: torch.Tensor | None = None
    if suffix_features is not None:
        cached = [block.features for block in blocks if block.features is not None]  # each [block, n*hidden]
        features = torch.cat([torch.cat(cached)[None], suffix_features], dim=1) if cached else suffix_features
    prefix_cache.store(token_ids, cache, features)
    return PromptPrefill(logits, features if capture else None, reused)
