"""DFlash linear speculative decoding: draft a block, verify it in one target pass, keep the agreed prefix.

Per round (batch of one):
  1. the drafter reads the features of the newly committed positions and proposes B-1 tokens after `pending`;
  2. the target runs [pending, d1 .. d_{B-1}] at positions start .. start+B-1, capturing features;
  3. a = longest prefix with d_{i+1} == choice_i; commit d1..da and the bonus choice_a;
  4. the target cache is cropped to start + a + 1 (the bonus has no K/V yet) and the features of block rows
     0..a become the drafter's next context rows, so drafter and target lengths move in step.

A DFlash2 drafter's chain comes from its candidate selector (`DFlash2Drafter.draft_chain`): greedy at temperature
0 (verified by the equality rule above), sampled otherwise, and then verified by speculative sampling with the q
the selector returns (`dflash.speculative.sampled_acceptance`). Greedy rounds go through `Forwards.draft_chain` (on
a GPU, the graph runner's graph of the drafter pass and the walk); there are no device-resident DFlash2 rounds.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from dflash.drafter.dflash2 import DFlash2Drafter
from dflash.drafter.model import DFlashDrafter
from dflash.generation.forwards import Forwards, forwards_for
from dflash.generation.output import OutputSink
from dflash.generation.request import GenerationRequest, GenerationStats
from dflash.generation.selection import TokenChooser
from dflash.kv.prefix_cache import PrefixCache
from dflash.models.model import CausalLM
from dflash.speculative.acceptance import accepted_prefix_length
from dflash.speculative.gate import SpeculationGate
from dflash.speculative.sampled_acceptance import speculative_sample
from dflash.speculative.session import SpecState, begin_speculation, plain_step


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
    prefix_cache: PrefixCache | None = None,
    forwards: Forwards | None = None,
    gate: SpeculationGate | None = None,
) -> GenerationStats:
    """`num_drafts` caps the drafts verified per round (default: block size - 1). `forwards` runs both models
    (default: the ones registered for the target). With `gate` each round speculates or is a plain step as its
    measurements say (`dflash.speculative.gate`; host-clocked: for synchronous devices)."""
    forwards = forwards_for(target) if forwards is None else forwards
    block_size = drafter.config.block_size
    drafts_per_round = min(num_drafts or block_size - 1, block_size - 1)
    layer_ids = drafter.config.target_layer_ids
    session = begin_speculation(
        target, drafter, request, sink, chooser, prefill_chunk=prefill_chunk, rows_per_round=drafts_per_round + 1,
        should_stop=should_stop, forwards=forwards, prefix_cache=prefix_cache,
    )
    if isinstance(session, GenerationStats):
        return session
    state, target_cache, drafter_cache, stats = session.state, session.target_cache, session.drafter_cache, session.stats
    finished = session.finished
    selector = drafter if isinstance(drafter, DFlash2Drafter) else None
    # speculative sampling with q needs the target's distribution on this rank (no token agreement across ranks)
    sample_with_q = selector is not None and not chooser.params.greedy and chooser.agreement is None
    resident = None
    if draft_window is None and selector is None and gate is None:
        resident = forwards.resident(
            target, chooser, target_cache, drafter=drafter, drafter_cache=drafter_cache, drafts=drafts_per_round,
            capture=tuple(layer_ids),
        )
    while not finished:
        if should_stop is not None and should_stop():
            sink.finish_cancelled()
            break
        if resident is not None and resident.take_over(
            state, drafter_cache, request.max_new_tokens, sink, chooser, stats, should_stop
        ):  # greedy rounds as device-resident graph replays, one queued ahead (`dflash.fastpath.resident`)
            break
        if gate is not None and not gate.speculate():
            started = time.perf_counter()
            state, finished = plain_step(target, forwards, state, target_cache, chooser, sink, layer_ids)
            stats.plain_steps += 1
            gate.record(False, time.perf_counter() - started, 1)
            continue
        started = time.perf_counter()
        chain = None
        if selector is not None:
            chain = forwards.draft_chain(
                selector, target, state.pending, state.start, state.new_features, drafter_cache,
                window=draft_window, num_drafts=drafts_per_round, temperature=chooser.params.temperature,
                generator=chooser.generator,
            )
            draft_tokens = chain.tokens  # [k]
        else:
            draft_tokens = forwards.draft_scores(
                drafter, target, state.pending, state.start, state.new_features, drafter_cache, window=draft_window,
                num_drafts=drafts_per_round,
            ).greedy()  # [k]
        block = torch.cat((draft_tokens.new_full((1,), state.pending), draft_tokens))[None]  # [1, k+1]
        out = forwards.forward(target, block, cache=target_cache, capture=layer_ids)
        assert out.logits is not None and out.features is not None
        # row i's prefix is the committed output plus draft[:i]; a constraint masks each row along that path
        allowed = chooser.allowed(draft_tokens.tolist()) if chooser.constrained else None
        if sample_with_q and chain is not None:
            probs = chooser.probabilities(out.logits[0], len(sink.token_ids), allowed)  # [k+1, vocab]
            accepted, last = speculative_sample(probs, draft_tokens, chain.q_over_vocab(probs.shape[-1]),
                                                chooser.generator)
        else:
            choices = chooser.choose(out.logits[0], len(sink.token_ids), allowed)  # [k+1]
            accepted = accepted_prefix_length(draft_tokens, choices)
            last = int(choices[accepted])
        committed = [*draft_tokens[:accepted].tolist(), last]
        stats.record_round(drafts_per_round, accepted)
        target_cache.crop(state.start + accepted + 1)
        state = SpecState(
            start=state.start + accepted + 1,
            pending=committed[-1],
            new_features=out.features[:, : accepted + 1],
        )
        chooser.observe(committed)
        finished = sink.push_many(committed)
        if gate is not None:
            gate.record(True, time.perf_counter() - started, len(committed))
    return session.close(sink)
