"""The speculation gate of lone DDTree requests on the CPU: which rounds speculate, from measured round times, and
that its choices never change the output."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from dflash.generation.sampling import SamplingParams
from dflash.speculative import gate as gate_module
from dflash.speculative.gate import PROBE_EVERY, PROBE_ROUNDS, WARM_ROUNDS, GateCosts, SpeculationGate
from tests.spec_helpers import golden_pair, run
from tests.test_ddtree_decode import GOLDEN_PROMPTS, run_ddtree

PATTERN = [True, False, False, True, True, False, True, False, False, False]


def _patterned(self: SpeculationGate) -> bool:
    """`SpeculationGate.speculate` forced to follow `PATTERN` (rounds and plain steps mixed)."""
    choice = PATTERN[len(self.choices) % len(PATTERN)]
    self.choices.append(choice)
    return choice


def _drive(gate: SpeculationGate, rounds: int, spec_seconds: float, plain_seconds: float,
           tokens: Callable[[int], int]) -> list[bool]:
    """Run `rounds` rounds: speculative ones take `spec_seconds` and commit `tokens(round)`, plain ones take
    `plain_seconds` and commit one token."""
    for index in range(rounds):
        speculative = gate.speculate()
        gate.record(speculative, spec_seconds if speculative else plain_seconds, tokens(index) if speculative else 1)
    return gate.choices[-rounds:]


def test_both_modes_are_measured_first_then_the_faster_is_taken() -> None:
    gate = SpeculationGate(GateCosts())
    # 3 tokens per 10 ms round against 1 per 5 ms step: speculating gives 300 tokens/s, plain steps 200
    choices = _drive(gate, 2 * WARM_ROUNDS + 20, 0.010, 0.005, lambda _: 3)
    assert choices[:2 * WARM_ROUNDS] == [True] * WARM_ROUNDS + [False] * WARM_ROUNDS
    assert all(choices[2 * WARM_ROUNDS:])
    # the same costs, a request whose rounds commit 1.2 tokens: 120 tokens/s, plain steps win once it has its own mean
    slow = SpeculationGate(gate.costs)
    later = _drive(slow, 30, 0.010, 0.005, lambda _: 1)
    assert later[:WARM_ROUNDS] == [True] * WARM_ROUNDS  # the engine's mean (about 3) until its own
    assert not any(later[WARM_ROUNDS + 1:])


def test_the_mode_not_taken_is_measured_again_every_so_often() -> None:
    gate = SpeculationGate(GateCosts())
    choices = _drive(gate, 2 * WARM_ROUNDS + 3 * (PROBE_EVERY + PROBE_ROUNDS), 0.020, 0.005, lambda _: 2)
    steady = choices[2 * WARM_ROUNDS:]
    assert sum(steady) == 3 * PROBE_ROUNDS  # plain steps win (100 against 200 tokens/s); three probes of two rounds
    first_probe = steady.index(True)
    assert first_probe == PROBE_EVERY and steady[first_probe:first_probe + PROBE_ROUNDS] == [True] * PROBE_ROUNDS


def test_a_round_that_feeds_the_drafter_context_is_not_timed() -> None:
    costs = GateCosts()
    gate = SpeculationGate(costs)
    gate.speculate()
    gate.record(True, 5.0, 3)  # a request's first round also reads its prompt's features: not timed
    assert costs.spec_seconds is None and costs.tokens == 3.0
    gate.speculate()
    gate.record(True, 0.010, 3)
    assert costs.spec_seconds == pytest.approx(0.010)
    gate.choices.append(False)  # a plain step, then a round that feeds the drafter its features
    gate.record(False, 0.005, 1)
    gate.choices.append(True)
    gate.record(True, 1.0, 2)
    assert costs.spec_seconds == pytest.approx(0.010) and costs.spec_rounds == 3 and costs.plain_rounds == 1


def test_any_mix_of_rounds_and_plain_steps_gives_the_plain_greedy_output(monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy DDTree with the gate's choices forced into a pattern (and with the real gate on the CPU's clock)
    commits what plain decoding commits; plain steps are counted apart from rounds."""
    target, drafter = golden_pair()
    prompt = GOLDEN_PROMPTS[3]
    sampling = SamplingParams()
    plain, _ = run(target, None, prompt, 60, sampling=sampling)
    tokens, stats = run_ddtree(target, drafter, prompt, 60, budget=8, sampling=sampling,
                               gate=SpeculationGate(GateCosts()))
    assert tokens == plain
    with monkeypatch.context() as mp:
        mp.setattr(gate_module.SpeculationGate, "speculate", _patterned)
        gate = SpeculationGate(GateCosts())
        tokens, stats = run_ddtree(target, drafter, prompt, 60, budget=8, sampling=sampling, gate=gate)
    assert tokens == plain
    assert stats.plain_steps == len(gate.choices) - sum(gate.choices) > 0
    assert stats.rounds >= sum(gate.choices) > 0  # + the last rounds, too short to draft


def test_the_engine_gates_lone_requests_on_the_cpu_but_not_seeded_sampling() -> None:
    from dflash.engine.engine import Engine, EngineOptions
    from dflash.generation.request import GenerationRequest
    from dflash.models.resolve import load_checkpoint

    target, drafter = golden_pair()
    tokenizer = load_checkpoint("default").tokenizer
    assert tokenizer is not None
    engine = Engine(target, tokenizer, drafter, EngineOptions(max_batch=1))
    assert engine.gate_costs is not None
    prompt = GOLDEN_PROMPTS[2]
    assert engine._gate("ddtree", GenerationRequest(prompt_ids=prompt)) is not None
    assert engine._gate("ddtree", GenerationRequest(prompt_ids=prompt, sampling=SamplingParams(temperature=0.7))) is not None
    seeded = GenerationRequest(prompt_ids=prompt, sampling=SamplingParams(temperature=0.7, seed=3))
    assert engine._gate("ddtree", seeded) is None
    first = engine.generate(seeded, spec="ddtree").token_ids
    assert engine.generate(seeded, spec="ddtree").token_ids == first
    greedy = engine.generate(GenerationRequest(prompt_ids=prompt, max_new_tokens=40), spec="ddtree")
    assert greedy.token_ids == run(target, None, prompt, 40)[0]
    assert engine.gate_costs["ddtree"].spec_rounds > 0
    always = Engine(target, tokenizer, drafter, EngineOptions(max_batch=1, always_speculate=True))
    assert always.gate_costs is None


def test_tensor_parallel_ranks_are_not_gated(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every rank must take the same rounds: measured times differ between ranks, so no gate there."""
    from types import SimpleNamespace

    from dflash.engine.engine import Engine, EngineOptions
    from dflash.models.resolve import load_checkpoint

    target, drafter = golden_pair()
    tokenizer = load_checkpoint("default").tokenizer
    assert tokenizer is not None
    monkeypatch.setattr(target, "tensor_parallel", SimpleNamespace(rank=0, world=2), raising=False)
    assert Engine(target, tokenizer, drafter, EngineOptions(max_batch=1)).gate_costs is None


@pytest.mark.parametrize("mode", ["linear", "ddtree"])
def test_rounds_mixed_with_plain_steps_feed_the_drafter_every_committed_position(
    monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """With the gate's choices forced into a pattern and a mostly right drafter, each drafter call after plain
    steps gets the features of every position it has not read ([its cache length, start)), equal to a fresh
    forward's; the output is plain decoding's and rounds still accept drafts."""
    from dflash.generation.output import OutputSink
    from dflash.generation.request import GenerationRequest
    from dflash.generation.selection import TokenChooser
    from dflash.speculative.linear import decode_linear
    from tests.spec_helpers import patch_draft_logits
    from tests.test_ddtree_decode import install_oracle

    target, drafter = golden_pair()
    prompt, max_new = GOLDEN_PROMPTS[4], 60
    plain, _ = run(target, None, prompt, max_new)
    seen: list[tuple[int, torch.Tensor, int]] = []

    def spy(original: Any, tgt: Any, pending: int, start: int, new_features: torch.Tensor, cache: Any,
            **kw: Any) -> torch.Tensor:
        seen.append((cache.length, new_features.clone(), start))
        return original(tgt, pending, start, new_features, cache, **kw)

    monkeypatch.setattr(gate_module.SpeculationGate, "speculate", _patterned)
    install_oracle(monkeypatch, drafter, prompt + run(target, None, prompt, max_new + 16)[0])
    patch_draft_logits(monkeypatch, drafter, spy)
    gate = SpeculationGate(GateCosts())
    if mode == "linear":
        sink = OutputSink(lambda ids: "", eos_ids=(), max_new_tokens=max_new)
        chooser = TokenChooser(SamplingParams(), eos_ids=(), min_tokens=0, vocab_size=target.config.vocab_size,
                               device="cpu")
        stats = decode_linear(target, drafter, GenerationRequest(prompt_ids=prompt, max_new_tokens=max_new), sink,
                              chooser, prefill_chunk=64, num_drafts=4, gate=gate)
        tokens = sink.token_ids
    else:
        tokens, stats = run_ddtree(target, drafter, prompt, max_new, budget=8, gate=gate)
    monkeypatch.undo()
    assert tokens == plain
    assert stats.plain_steps == len(gate.choices) - sum(gate.choices) > 0 and stats.acceptance_length > 2.0
    reference = target(torch.tensor([prompt + tokens]), capture=drafter.config.target_layer_ids, logits="none").features
    assert reference is not None and len(seen) >= sum(gate.choices)
    for drafter_len, new_features, start in seen:
        assert drafter_len + new_features.shape[1] == start
        torch.testing.assert_close(new_features, reference[:, drafter_len:start], atol=1e-4, rtol=1e-4)
