"""Chunked prefill: the prompt goes through the target in pieces of at most `chunk` tokens.

Features of every chunk are concatenated (never overwritten), so a drafter sees every prompt position.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from dflash.generation.forwards import Forwards, forwards_for
from dflash.kv.cache import KVCache
from dflash.models.model import CausalLM


def chunked_prefill(
    model: CausalLM,
    cache: KVCache,
    input_ids: torch.Tensor,
    *,
    chunk: int,
    capture: Sequence[int] = (),
    should_stop: Callable[[], bool] | None = None,
    forwards: Forwards | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """input_ids: [1, prompt] -> (last-position logits [1, vocab], features [1, prompt, n*hidden] or None).

    `should_stop` is polled before every chunk. When it asks to abandon the prefill, the logits are None and the
    features cover only the chunks completed so far ([1, done, n*hidden], or None when none were captured); the
    cache then holds exactly those chunks, so a caller can keep them (`dflash.generation.cached_prefill`).
    `forwards` runs the model (default: the ones registered for it) and may lower the chunk to shapes it serves.
    """
    forwards = forwards_for(model) if forwards is None else forwards
    total = input_ids.shape[1]
    chunk = forwards.prefill_chunk(chunk)
    features: list[torch.Tensor] = []
    logits: torch.Tensor | None = None
    for lo in range(0, total, max(1, chunk)):
        if should_stop is not None and should_stop():
            return None, (torch.cat(features, dim=1) if features else None)
        last = lo + chunk >= total
        out = forwards.forward(
            model, input_ids[:, lo : lo + chunk], cache=cache, capture=capture, logits="last" if last else "none"
        )
        if out.features is not None:
            features.append(out.features)
        if last:
            assert out.logits is not None
            logits = out.logits[:, -1]
    return logits, (torch.cat(features, dim=1) if features else None)
