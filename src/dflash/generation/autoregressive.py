"""Plain autoregressive decoding with the static KV cache: the reference every speculative path must equal."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from dflash.generation.cached_prefill import prefill_prompt
from dflash.generation.clock import elapsed_since
from dflash.generation.forwards import Forwards, forwards_for
from dflash.generation.output import OutputSink
from dflash.generation.request import GenerationRequest, GenerationStats
from dflash.generation.selection import TokenChooser
from dflash.kv.prefix_cache import PrefixCache
from dflash.models.model import CausalLM


@torch.inference_mode()
def decode_autoregressive(
    model: CausalLM,
    request: GenerationRequest,
    sink: OutputSink,
    chooser: TokenChooser,
    *,
    prefill_chunk: int,
    should_stop: Callable[[], bool] | None = None,
    prefix_cache: PrefixCache | None = None,
    forwards: Forwards | None = None,
) -> GenerationStats:
    """Prefill the prompt (through `prefix_cache` when given), then one target step per token until the sink
    finishes. `forwards` runs the model (default: the ones registered for it)."""
    forwards = forwards_for(model) if forwards is None else forwards
    device = model.embed_tokens.weight.device
    prompt = torch.tensor([request.prompt_ids], dtype=torch.long, device=device)
    stats = GenerationStats(prompt_tokens=prompt.shape[1])
    cache = forwards.new_target_cache(model, prompt.shape[1] + request.max_new_tokens + 1)
    started = time.perf_counter()
    prefilled = prefill_prompt(
        model, cache, prompt, chunk=prefill_chunk, should_stop=should_stop, prefix_cache=prefix_cache,
        forwards=forwards,
    )
    if prefilled is None:
        sink.finish_cancelled()
        return stats
    logits = prefilled.logits
    stats.cached_tokens = prefilled.cached_tokens
    stats.prefill_s = elapsed_since(started, device)
    started = time.perf_counter()
    step_input = torch.empty((1, 1), dtype=torch.long, device=device)
    resident = forwards.resident(model, chooser, cache)
    while True:
        token = int(chooser.choose(logits, len(sink.token_ids))[0])
        chooser.observe([token])
        if sink.push(token):
            break
        if should_stop is not None and should_stop():
            sink.finish_cancelled()
            break
        produced = len(sink.token_ids)
        if (
            resident is not None and chooser.min_tokens <= produced and not chooser.constrained
            and resident.fits(cache.length, request.max_new_tokens - produced)
        ):  # greedy steps as device-resident graph replays, one queued ahead (`dflash.fastpath.resident`)
            resident.load_plain(cache.length, token)
            resident.decode(cache.length, sink, stats, should_stop)
            break
        step_input[0, 0] = token
        out = forwards.forward(model, step_input, cache=cache)
        assert out.logits is not None
        logits = out.logits[:, -1]
    stats.decode_s = time.perf_counter() - started
    stats.completion_tokens = len(sink.token_ids)
    return stats
