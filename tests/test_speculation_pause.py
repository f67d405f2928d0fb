"""Speculation paused under sustained load (`dflash.batch.speculation_pause`): after a run of steps in which every one
of many speculative requests took a plain step, they decode as plain requests (their drafter state freed), arrivals
start plain while the pause holds, and no request's tokens change."""

from __future__ import annotations

from typing import Any

import pytest

from dflash.batch import speculation_pause
from dflash.batch.core import BatchCore
from dflash.batch.sequence import Sequence
from dflash.batch.speculation_pause import HOLD_STEPS, MIN_REQUESTS, PAUSE_AFTER, SpeculationPause
from dflash.generation.sampling import SamplingParams
from tests.batch_helpers import drain, make_core, make_sequence
from tests.spec_helpers import golden_pair, one_torch_thread, random_prompts

_one_thread = one_torch_thread  # autouse, module scope


def test_a_pause_needs_a_run_of_plain_steps_of_enough_speculative_requests() -> None:
    pause = SpeculationPause()
    for step in range(PAUSE_AFTER - 1):
        assert not pause.due(step, MIN_REQUESTS, True)
    assert not pause.due(PAUSE_AFTER - 2, MIN_REQUESTS, True)  # a step planned twice counts once
    assert not pause.due(PAUSE_AFTER - 1, MIN_REQUESTS, False)  # a round: the run starts again
    for step in range(PAUSE_AFTER, 2 * PAUSE_AFTER - 1):
        assert not pause.due(step, MIN_REQUESTS, True)
    assert pause.due(2 * PAUSE_AFTER - 1, MIN_REQUESTS, True) and pause.pauses == 1
    assert pause.holds(2 * PAUSE_AFTER, MIN_REQUESTS)
    assert not pause.holds(2 * PAUSE_AFTER + HOLD_STEPS, MIN_REQUESTS)  # held long enough: arrivals speculate
    few = SpeculationPause()
    assert not any(few.due(step, MIN_REQUESTS - 1, True) for step in range(3 * PAUSE_AFTER))
    dropping = SpeculationPause()
    for step in range(PAUSE_AFTER):
        dropping.due(step, MIN_REQUESTS, True)
    assert not dropping.holds(PAUSE_AFTER, MIN_REQUESTS // 2 - 1)  # the load fell: the pause ends


SAMPLING = [SamplingParams(temperature=1.0, seed=index) for index in range(MIN_REQUESTS + 1)]


def _run(monkeypatch: pytest.MonkeyPatch, pause_after: int) -> tuple[BatchCore, list[Sequence], list[list[int]]]:
    """MIN_REQUESTS seeded sampled DDTree requests on a core whose chooser takes plain steps only, then one more
    arriving after `pause_after` steps of decoding; speculation pauses after `pause_after` such steps."""
    monkeypatch.setattr(speculation_pause, "PAUSE_AFTER", pause_after)
    target, drafter = golden_pair()
    core = make_core(target, drafter, max_batch=MIN_REQUESTS + 1, eager_padded=True, pool_tokens=16384)
    core.tree_budgets.forced = False  # every step plain: speculation never pays here
    prompts = random_prompts(MIN_REQUESTS + 1, target.config.vocab_size, seed=9, lengths=(7, 12, 20))
    seqs = [make_sequence(target, p, 40, "ddtree", sampling=s) for p, s in zip(prompts, SAMPLING, strict=True)]
    for seq in seqs[:-1]:
        core.add(seq)
    while any(seq.phase != "decode" for seq in seqs[:-1]):
        core.step()
    for _ in range(12):
        core.step()
    core.add(seqs[-1])
    drain(core)
    assert all(seq.error is None for seq in seqs)
    return core, seqs, [seq.sink.token_ids for seq in seqs]


def test_requests_decode_plainly_once_speculation_pauses_and_give_the_same_tokens(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    core, seqs, paused = _run(monkeypatch, pause_after=8)
    assert core.pause.pauses == 1 and core.pause.paused_requests == MIN_REQUESTS + 1
    assert all(seq.mode == "none" and seq.drafter is None for seq in seqs)  # the arrival started plain
    assert core.drafter_pool is not None and core.drafter_pool.free_blocks == core.drafter_pool.num_blocks
    control, control_seqs, speculating = _run(monkeypatch, pause_after=10_000)
    assert control.pause.pauses == 0 and all(seq.mode == "ddtree" for seq in control_seqs)
    assert paused == speculating  # seeded: the same draws whether a request speculates or not


def test_a_few_requests_keep_speculating(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(speculation_pause, "PAUSE_AFTER", 2)
    target, drafter = golden_pair()
    core = make_core(target, drafter, max_batch=8, eager_padded=True)
    core.tree_budgets.forced = False
    prompts = random_prompts(4, target.config.vocab_size, seed=4, lengths=(9, 14))
    seqs = [make_sequence(target, p, 20, "ddtree", sampling=SAMPLING[i]) for i, p in enumerate(prompts)]
    for seq in seqs:
        core.add(seq)
    drain(core)
    assert core.pause.pauses == 0 and all(seq.mode == "ddtree" for seq in seqs)


def test_arrivals_after_a_pause_take_plain_steps_beside_the_paused_requests_then_speculate(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Once the pause stops holding, an arriving speculative request takes plain steps while paused requests decode
    (no round of mixed kinds), and speculates when they have ended; its tokens are the ones it draws alone."""
    monkeypatch.setattr(speculation_pause, "PAUSE_AFTER", 4)
    monkeypatch.setattr(speculation_pause, "HOLD_STEPS", 6)
    target, drafter = golden_pair()
    core = make_core(target, drafter, max_batch=MIN_REQUESTS + 1, eager_padded=True, pool_tokens=16384)
    core.tree_budgets.forced = False
    prompts = random_prompts(MIN_REQUESTS + 1, target.config.vocab_size, seed=12, lengths=(8, 15))
    seqs = [make_sequence(target, p, 30, "ddtree", sampling=s) for p, s in zip(prompts, SAMPLING, strict=True)]
    for seq in seqs[:-1]:
        core.add(seq)
    while core.pause.pauses == 0:
        core.step()
    for _ in range(8):  # the hold (6 steps) runs out
        core.step()
    late = seqs[-1]
    core.add(late)
    kinds: list[tuple[bool, str]] = []  # (paused requests still decoding, the late request's round kind)
    plan = core._plan_rounds

    def spy(decoders: list[Sequence]) -> list[Any]:
        rounds = plan(decoders)
        kinds.extend((any(s.paused for s in decoders), r.kind) for r in rounds if r.seq is late)
        return rounds

    monkeypatch.setattr(core, "_plan_rounds", spy)
    core.tree_budgets.forced = True
    drain(core)
    assert late.error is None and not late.paused and late.mode == "ddtree"
    beside = [kind for paused, kind in kinds if paused]
    assert beside and set(beside) == {"plain"}
    assert any(kind == "tree" for paused, kind in kinds if not paused) and late.drafted_rounds > 0
    alone = make_core(target, drafter, max_batch=2, eager_padded=True)
    again = make_sequence(target, prompts[-1], 30, "ddtree", sampling=SAMPLING[-1])
    alone.add(again)
    drain(alone)
    assert again.sink.token_ids == late.sink.token_ids


@pytest.mark.parametrize(("gain", "pauses"), [(0.5, 1), (0.9, 0)])
def test_only_rounds_predicted_clearly_slower_than_plain_steps_pause(
    monkeypatch: pytest.MonkeyPatch, gain: float, pauses: int
) -> None:
    """Plain steps chosen near break-even (the chooser's best round predicted at 0.9x a plain step) never pause
    speculation; chosen where rounds are predicted at half a plain step's speed, they do."""
    monkeypatch.setattr(speculation_pause, "PAUSE_AFTER", 4)
    target, drafter = golden_pair()
    core = make_core(target, drafter, max_batch=MIN_REQUESTS, eager_padded=True, pool_tokens=16384)
    monkeypatch.setattr(core.tree_budgets, "choose", lambda *args: 0)
    monkeypatch.setattr(core.tree_budgets, "round_gain", lambda bucket: gain)
    prompts = random_prompts(MIN_REQUESTS, target.config.vocab_size, seed=5, lengths=(6, 11))
    sampling = SAMPLING[:MIN_REQUESTS]
    seqs = [make_sequence(target, p, 24, "ddtree", sampling=s) for p, s in zip(prompts, sampling, strict=True)]
    for seq in seqs:
        core.add(seq)
    drain(core)
    assert all(seq.error is None for seq in seqs)
    assert core.pause.pauses == pauses and core.pause.gains == [gain] * pauses
    assert all(seq.mode == ("none" if pauses else "ddtree") for seq in seqs)
