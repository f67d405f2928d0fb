"""What every speculative strategy does before its first round: prefill with feature capture, first token.

`begin_speculation` prefills the prompt through the target (chunked, capturing the drafter's feature layers),
chooses and commits the first token, and returns the caches and the state the rounds start from.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from dflash.drafter.model import DFlashDrafter
from dflash.generation.cached_prefill import prefill_prompt
from dflash.generation.clock import elapsed_since
from dflash.generation.forwards import Forwards
from dflash.generation.output import OutputSink
from dflash.generation.request import GenerationRequest, GenerationStats
from dflash.generation.selection import TokenChooser
from dflash.kv.cache import KVCache
from dflash.kv.prefix_cache import PrefixCache
from dflash.models.model import CausalLM


@dataclass
class SpecState:
    """Where a speculative generation stands; every length is in positions of the sequence."""

    start: int  # position of the pending token (the next token without target K/V)
    pending: int  # committed token at `start`, input of the next round's block slot 0
    new_features: torch.Tensor  # [1, start - drafter_cache.length, n*hidden]: not yet seen by the drafter


@dataclass
class SpecSession:
    state: SpecState
    target_cache: KVCache
    drafter_cache: KVCache
    stats: GenerationStats
    decode_started: float  # perf_counter() when decoding began (after the prefill)
    finished: bool  # the first token already ended the generation

    def close(self, sink: OutputSink) -> GenerationStats:
        self.stats.decode_s = time.perf_counter() - self.decode_started
        self.stats.completion_tokens = len(sink.token_ids)
        return self.stats


def begin_speculation(
    target: CausalLM,
    drafter: DFlashDrafter,
    request: GenerationRequest,
    sink: OutputSink,
    chooser: TokenChooser,
    *,
    prefill_chunk: int,
    rows_per_round: int,
    should_stop: Callable[[], bool] | None = None,
    forwards: Forwards,
    prefix_cache: PrefixCache | None = None,
) -> SpecSession | GenerationStats:
    """Prefill and commit the first token. Returns the stats alone when the prefill was cancelled.

    `rows_per_round` is the most rows a round writes after the committed prefix (sizes the caches). Each prefill
    chunk's features go into the drafter's cache as the chunk completes. With a usable `prefix_cache`, a cached
    prefix restores both the target K/V and the features of its positions instead, and the drafter reads the
    features of every prompt position on its first round. `forwards` runs both models
    and makes their caches."""
    device = target.embed_tokens.weight.device
    prompt = torch.tensor([request.prompt_ids], dtype=torch.long, device=device)
    stats = GenerationStats(prompt_tokens=prompt.shape[1])
    capacity = prompt.shape[1] + request.max_new_tokens + rows_per_round + 1
    target_cache = forwards.new_target_cache(target, capacity)
    # the drafter writes its block's keys and values in the free slots after its context
    drafter_cache = forwards.new_drafter_cache(drafter, capacity + drafter.config.block_size)
    started = time.perf_counter()
    absorbed: list[torch.Tensor] = []  # the first chunk's features, for the width of an empty remainder

    def absorb(chunk_features: torch.Tensor, start: int) -> None:
        """Each prefill chunk's features straight into the drafter's cache: a long prompt's features (1.6 GiB at
        27B and 32K positions) are never all alive, and its first round reads no backlog."""
        forwards.absorb_draft_context(drafter, chunk_features, start, drafter_cache)
        if not absorbed:  # an empty tensor of their width, not a view that would keep this chunk alive
            absorbed.append(chunk_features.new_empty(1, 0, chunk_features.shape[-1]))

    prefilled = prefill_prompt(
        target, target_cache, prompt, chunk=prefill_chunk, capture=drafter.config.target_layer_ids,
        should_stop=should_stop, prefix_cache=prefix_cache, forwards=forwards, on_features=absorb,
    )
    if prefilled is None:
        sink.finish_cancelled()
        return stats
    logits = prefilled.logits
    features = prefilled.features if prefilled.features is not None else absorbed[0]
    # [1, prompt, n*hidden] from a prefix cache, else [1, 0, n*hidden]: the drafter holds every prompt position
    stats.cached_tokens = prefilled.cached_tokens
    stats.prefill_s = elapsed_since(started, device)
    decode_started = time.perf_counter()
    first = int(chooser.choose(logits, 0)[0])
    chooser.observe([first])
    state = SpecState(start=prompt.shape[1], pending=first, new_features=features)
    return SpecSession(state, target_cache, drafter_cache, stats, decode_started, finished=sink.push(first))


def plain_step(
    target: CausalLM, forwards: Forwards, state: SpecState, target_cache: KVCache, chooser: TokenChooser,
    sink: OutputSink, layer_ids: Sequence[int],
) -> tuple[SpecState, bool]:
    """One plain decoding step inside a speculative loop (the speculation gate's choice): the target's next token;
    its features join the ones the drafter has not read yet. -> (the new state, whether the output is finished)."""
    block = torch.tensor([[state.pending]], dtype=torch.long, device=target.embed_tokens.weight.device)  # [1, 1]
    out = forwards.forward(target, block, cache=target_cache, capture=layer_ids)
    assert out.logits is not None and out.features is not None
    allowed = chooser.allowed([]) if chooser.constrained else None
    token = int(chooser.choose(out.logits[0], len(sink.token_ids), allowed)[0])
    state = SpecState(
        start=state.start + 1, pending=token, new_features=torch.cat((state.new_features, out.features), dim=1)
    )
    chooser.observe([token])
    return state, sink.push_many([token])
