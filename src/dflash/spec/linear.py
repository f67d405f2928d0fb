"""DFlash linear speculative decoding: draft a block, verify it in one target pass, keep the agreed prefix.

Per round (batch of one):
  1. the drafter reads the features of the newly committed positions and proposes B-1 tokens after `pending`;
  2. the target runs [pending, d1 .. d_{B-1}] at positions start .. start+B-1, capturing features;
  3. a = longest prefix with d_{i+1} == choice_i; commit d1..da and the bonus choice_a;
  4. the target cache is cropped to start + a + 1 (the bonus has no K/V yet) and the features of block rows
     0..a become the drafter's next context rows, so drafter and target lengths move in step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dflash.generation.output import OutputSink
from dflash.generation.prefill import chunked_prefill
from dflash.generation.request import GenerationRequest, GenerationStats
from dflash.generation.selection import TokenChooser
from dflash.models.model import CausalLM
from dflash.spec.acceptance import accepted_prefix_length
from dflash.spec.drafter import DFlashDrafter


@dataclass
class SpecState:
    """Where a speculative generation stands; every length is in positions of the sequence."""

    start: int  # position of the pending token (the next token without target K/V)
    pending: int  # committed token at `start`, input of the next round's block slot 0
    new_features: torch.Tensor  # [1, start - drafter_cache.length, n*hidden]: not yet seen by the drafter


@torch.inference_mode()
def decode_linear(
    target: CausalLM,
    drafter: DFlashDrafter,
    request: GenerationRequest,
    sink: OutputSink,
    chooser: TokenChooser,
    *,
    prefill_chunk: int,
    draft_window: int | None = None,
    num_drafts: int | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> GenerationStats:
    """`num_drafts` caps the drafts verified per round (default: block size - 1)."""
    device = target.embed_tokens.weight.device
    block_size = drafter.config.block_size
    drafts_per_round = min(num_drafts or block_size - 1, block_size - 1)
    layer_ids = drafter.config.target_layer_ids
    prompt = torch.tensor([request.prompt_ids], dtype=torch.long, device=device)
    stats = GenerationStats(prompt_tokens=prompt.shape[1])
    capacity = prompt.shape[1] + request.max_new_tokens + drafts_per_round + 2
    target_cache = target.new_cache(capacity)
    drafter_cache = drafter.new_cache(capacity)

    started = time.perf_counter()
    logits, features = chunked_prefill(
        target, target_cache, prompt, chunk=prefill_chunk, capture=layer_ids, should_stop=should_stop
    )
    if logits is None or features is None:
        sink.finish_cancelled()
        return stats
    stats.prefill_s = time.perf_counter() - started
    started = time.perf_counter()
    first = int(chooser.choose(logits, 0)[0])
    chooser.observe([first])
    state = SpecState(start=prompt.shape[1], pending=first, new_features=features)
    finished = sink.push(first)
    while not finished:
        if should_stop is not None and should_stop():
            sink.finish_cancelled()
            break
        draft_logits = drafter.draft_logits(
            target, state.pending, state.start, state.new_features, drafter_cache, window=draft_window,
            num_drafts=drafts_per_round,
        )  # [k, vocab]
        draft_tokens = draft_logits.argmax(dim=-1)  # [k]
        block = torch.cat((torch.tensor([state.pending], device=device), draft_tokens))[None]  # [1, k+1]
        out = target(block, cache=target_cache, capture=layer_ids)
        assert out.logits is not None and out.features is not None
        choices = chooser.choose(out.logits[0], len(sink.token_ids))  # [k+1]
        accepted = accepted_prefix_length(draft_tokens, choices)
        committed = [*draft_tokens[:accepted].tolist(), int(choices[accepted])]
        stats.record_round(drafts_per_round, accepted)
        target_cache.crop(state.start + accepted + 1)
        state = SpecState(
            start=state.start + accepted + 1,
            pending=committed[-1],
            new_features=out.features[:, : accepted + 1],
        )
        chooser.observe(committed)
        finished = sink.push_many(committed)
    stats.decode_s = time.perf_counter() - started
    stats.completion_tokens = len(sink.token_ids)
    return stats
