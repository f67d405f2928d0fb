"""Chunked prefill: the prompt goes through the target in pieces of at most `chunk` tokens.

Features of every chunk are kept (written into one tensor of the prompt's length, never overwritten), so a drafter
sees every prompt position; or each chunk's are handed to a consumer as soon as they exist (`on_features`: a
drafter taking them into its cache), so a long prompt's features are never all alive at once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from dflash.generation.forwards import Forwards, forwards_for
from dflash.kv.cache import KVCache
from dflash.models.model import CausalLM

# (features [1, rows, n*hidden] of one chunk, the position of its first row)
FeatureSink = Callable[[torch.Tensor, int], None]


def chunked_prefill(
    model: CausalLM,
    cache: KVCache,
    input_ids: torch.Tensor,
    *,
    chunk: int,
    capture: Sequence[int] = (),
    should_stop: Callable[[], bool] | None = None,
    forwards: Forwards | None = None,
    on_features: FeatureSink | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """input_ids: [1, prompt] -> (last-position logits [1, vocab], features [1, prompt, n*hidden] or None).

    `should_stop` is polled before every chunk. When it asks to abandon the prefill, the logits are None and the
    features cover only the chunks completed so far ([1, done, n*hidden], or None when none were captured); the
    cache then holds exactly those chunks, so a caller can keep them (`dflash.generation.cached_prefill`).
    `forwards` runs the model (default: the ones registered for it) and may lower the chunk to shapes it serves.
    `on_features` takes each chunk's features instead (positions counted from the cache's start); the features
    returned are then None.
    """
    forwards = forwards_for(model) if forwards is None else forwards
    total = input_ids.shape[1]
    start = cache.length
    chunk = max(1, forwards.prefill_chunk(chunk))
    features: torch.Tensor | None = None  # [1, total, n*hidden], filled chunk by chunk
    logits: torch.Tensor | None = None
    for lo in range(0, total, chunk):
        if should_stop is not None and should_stop():
            return None, (None if features is None else features[:, :lo])
        last = lo + chunk >= total
        out = forwards.forward(
            model, input_ids[:, lo : lo + chunk], cache=cache, capture=capture, logits="last" if last else "none"
        )
        if out.features is not None:
            if on_features is not None:
                on_features(out.features, start + lo)
            else:
                if features is None:
                    features = out.features.new_empty(1, total, out.features.shape[-1])
                features[:, lo : lo + out.features.shape[1]] = out.features
        if last:
            assert out.logits is not None
            logits = out.logits[:, -1]
    return logits, features
