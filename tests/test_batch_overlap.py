"""Plain greedy steps launched one ahead of reading their tokens (`dflash.batch.overlap`), run eagerly on the CPU
through the padded passes: every request still gets its tokens alone, whatever stops, joins, is cancelled or
speculates around it, and nothing is left in the pool."""

from __future__ import annotations

from typing import Any

import pytest

from dflash.batch.overlap import OverlappedSteps
from dflash.generation.sampling import SamplingParams
from tests.batch_helpers import count_launches, drain, make_core, make_sequence, overlap_on_and_off
from tests.spec_helpers import golden_pair, one_torch_thread, random_prompts, run

_one_thread = one_torch_thread  # autouse, module scope


def test_overlapped_plain_requests_get_their_tokens_alone() -> None:
    """Plain requests of different prompt and output lengths, two of them stopping at EOS mid-way: the same tokens
    as alone (float32), most steps launched ahead, the pool whole again after."""
    target, _ = golden_pair()
    prompts = random_prompts(6, target.config.vocab_size, seed=5, lengths=(7, 60, 23, 3))
    lengths = [20, 9, 31, 14, 25, 5]
    references = [run(target, None, p, n)[0] for p, n in zip(prompts, lengths, strict=True)]
    eos = {1: references[1][4], 4: references[4][11]}  # tokens these two requests produce: each stops there
    expected = [r[: r.index(eos[i]) + 1] if i in eos else r for i, r in enumerate(references)]
    core = make_core(target, None, max_batch=6, eager_padded=True)
    launches = count_launches(core)
    seqs = [make_sequence(target, p, n, "none", eos=(eos[i],) if i in eos else ())
            for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))]
    for seq in seqs:
        core.add(seq)
    steps = drain(core)
    assert len(launches) > steps // 2 and max(launches) >= 4
    for seq, tokens in zip(seqs, expected, strict=True):
        assert seq.error is None
        assert seq.sink.token_ids == tokens
    assert core.target_pool.free_blocks == core.target_pool.num_blocks


def test_requests_joining_and_cancelled_between_launched_steps() -> None:
    """A request cancelled while its next token is in flight ends with a prefix of its tokens alone; requests that
    arrive while others run ahead (a prompt-cache hit among them) join the launched steps and still get their tokens
    alone; a sampled request among them gets all its tokens."""
    target, _ = golden_pair()
    prompts = random_prompts(3, target.config.vocab_size, seed=13, lengths=(40, 9))
    prompts.append(list(prompts[0]))  # the same prompt again: its blocks come from the prefix cache if one is set
    references = [run(target, None, p, 24)[0] for p in prompts]
    core = make_core(target, None, max_batch=5, prefill_chunk=16, eager_padded=True)
    launches = count_launches(core)
    stop_now = {"flag": False}
    seqs = [make_sequence(target, prompts[0], 24, "none"),
            make_sequence(target, prompts[1], 24, "none", should_stop=lambda: stop_now["flag"])]
    for seq in seqs:
        core.add(seq)
    for _ in range(12):
        core.step()
    assert launches, "no step was launched ahead"
    stop_now["flag"] = True
    late = [make_sequence(target, prompts[2], 24, "none"), make_sequence(target, prompts[3], 24, "none")]
    sampled = make_sequence(target, prompts[2], 10, "none", sampling=SamplingParams(temperature=1.0, seed=3))
    for seq in (*late, sampled):
        core.add(seq)
    drain(core)
    cancelled = seqs[1]
    assert cancelled.sink.finish_reason == "cancelled"
    assert cancelled.sink.token_ids == references[1][: len(cancelled.sink.token_ids)]
    assert seqs[0].sink.token_ids == references[0]
    assert [s.sink.token_ids for s in late] == references[2:]
    assert sampled.error is None and len(sampled.sink.token_ids) == 10
    assert core.target_pool.free_blocks == core.target_pool.num_blocks


def test_speculative_requests_ride_overlapped_plain_steps_and_speculate_again() -> None:
    """DDTree and linear requests that the policy keeps plain for a while (their features carried through the
    launched steps), then speculate again: their tokens alone."""
    target, drafter = golden_pair()
    prompts = random_prompts(4, target.config.vocab_size, seed=17, lengths=(12, 33))
    references = [run(target, None, p, 28)[0] for p in prompts]
    core = make_core(target, drafter, max_batch=4, eager_padded=True)
    launches = count_launches(core)
    speculate = {"on": False}
    core.policy.plan = lambda *args, **kwargs: speculate["on"]
    seqs = [make_sequence(target, p, 28, ("ddtree", "linear")[i % 2]) for i, p in enumerate(prompts)]
    for seq in seqs:
        core.add(seq)
    for _ in range(12):
        core.step()
    assert launches
    _speculate_to_the_end(core, speculate, seqs, references)


def _speculate_to_the_end(core: Any, speculate: dict[str, bool], seqs: list[Any], references: list[list[int]]) -> None:
    """Speculation on again until every request ends: each gets its tokens alone, and each did speculate."""
    speculate["on"] = True
    drain(core)
    for seq, reference in zip(seqs, references, strict=True):
        assert seq.error is None
        assert seq.sink.token_ids == reference, seq.mode
    assert all(seq.stats.draft_tokens for seq in seqs)  # they did speculate after the plain steps


def test_a_failed_launch_ends_its_requests_with_the_error() -> None:
    target, _ = golden_pair()
    prompts = random_prompts(3, target.config.vocab_size, seed=19, lengths=(10,))
    core = make_core(target, None, max_batch=3, eager_padded=True)
    assert core.overlap is not None
    seqs = [make_sequence(target, p, 30, "none") for p in prompts]
    for seq in seqs:
        core.add(seq)
    for _ in range(6):
        core.step()
    assert core.overlap.launched is not None

    def broken(*args: Any) -> Any:
        raise RuntimeError("device lost")

    core.overlap.graphs.launch = broken
    drain(core)
    assert all(isinstance(seq.error, RuntimeError) for seq in seqs)
    assert core.overlap.launched is None
    assert core.target_pool.free_blocks == core.target_pool.num_blocks


def test_the_launched_tokens_follow_each_request_when_the_batch_shrinks() -> None:
    """After a request ends, the next launch takes the others' tokens from their places in the launched step."""
    target, _ = golden_pair()
    core = make_core(target, None, max_batch=3, eager_padded=True)
    assert isinstance(core.overlap, OverlappedSteps)
    prompts = random_prompts(3, target.config.vocab_size, seed=23, lengths=(8, 15))
    lengths = [6, 19, 19]  # the first ends early: the other two move up a place
    references = [run(target, None, p, n)[0] for p, n in zip(prompts, lengths, strict=True)]
    seqs = [make_sequence(target, p, n, "none") for p, n in zip(prompts, lengths, strict=True)]
    for seq in seqs:
        core.add(seq)
    sizes = count_launches(core)
    drain(core)
    assert 3 in sizes and 2 in sizes
    assert [s.sink.token_ids for s in seqs] == references


def test_seeded_sampled_requests_draw_the_same_tokens_launched_ahead(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sampled requests (temperature, top-p, top-k; seeded) beside greedy ones are launched ahead too, each drawing
    from its own random stream in the same order: the same tokens with overlap on and off (DFLASH_BATCH_OVERLAP=0:
    no launches at all)."""
    target, _ = golden_pair()
    prompts = random_prompts(5, target.config.vocab_size, seed=29, lengths=(9, 21))
    sampling = [SamplingParams(temperature=0.9, top_p=0.9, seed=1), SamplingParams(), SamplingParams(temperature=1.2,
                top_k=20, seed=2), SamplingParams(temperature=0.7, seed=3), SamplingParams()]
    outputs, launched = overlap_on_and_off(monkeypatch, target, prompts, sampling, 18, eager_padded=True)
    assert outputs[0] == outputs[1]
    assert launched[0] > 10 and launched[1] == 0


def _count_chain_breaks(core: Any) -> list[int]:
    """Count the core's steps that read a launched step before launching the next (the chain broken): [count]."""
    breaks = [0]
    read = core._read_launched

    def counted() -> None:
        breaks[0] += core.overlap is not None and core.overlap.launched is not None
        read()

    core._read_launched = counted
    return breaks


def _arrivals_beside_launched_steps(
    core: Any, target: Any, prompts: list[list[int]], sampling: list[SamplingParams], lengths: list[int],
    arrive_at: list[int],
) -> tuple[list[Any], int]:
    """Requests added at the given steps of a running core: (their sequences, how many steps read a launched step
    before launching the next: the chain broken)."""
    breaks = _count_chain_breaks(core)
    seqs = [make_sequence(target, p, n, "none", sampling=s)
            for p, n, s in zip(prompts, lengths, sampling, strict=True)]
    step = 0
    while step <= max(arrive_at) or core.active or core.waiting:
        for seq, at in zip(seqs, arrive_at, strict=True):
            if at == step:
                core.add(seq)
        core.step()
        step += 1
        assert step < 2_000, "the core did not finish"
    return seqs, breaks[0]


def test_prompts_run_beside_launched_steps_and_their_requests_join_the_chain(monkeypatch: pytest.MonkeyPatch) -> None:
    """Requests arriving one by one while others run ahead, prompts of several chunks among them, one request ending
    early (a later one takes its place), greedy and seeded sampled ones: their prompts run beside the launched steps
    and they join the next launch, so after the first launch no step reads the chain first; every request gets the
    tokens it gets without launched steps (greedy ones: alone)."""
    target, _ = golden_pair()
    prompts = random_prompts(6, target.config.vocab_size, seed=37, lengths=(12, 40, 7))
    sampling = [SamplingParams(), SamplingParams(temperature=0.9, top_p=0.9, seed=4), SamplingParams(),
                SamplingParams(temperature=1.1, top_k=30, seed=5), SamplingParams(), SamplingParams()]
    lengths = [24, 20, 6, 18, 22, 15]
    arrive_at = [0, 0, 3, 5, 9, 12]
    outputs, breaks, prefill_steps = [], [], []
    for overlap in ("1", "0"):
        monkeypatch.setenv("DFLASH_BATCH_OVERLAP", overlap)
        core = make_core(target, None, max_batch=6, prefill_chunk=16, eager_padded=True)
        assert (core.overlap is not None) == (overlap == "1")
        launches = count_launches(core) if core.overlap is not None else []
        seqs, broken = _arrivals_beside_launched_steps(core, target, prompts, sampling, lengths, arrive_at)
        assert all(seq.error is None for seq in seqs)
        assert core.target_pool.free_blocks == core.target_pool.num_blocks
        outputs.append([seq.sink.token_ids for seq in seqs])
        breaks.append(broken)
        prefill_steps.append(core.step_kinds.get("prefill", [0])[0])
        if overlap == "1":
            assert len(launches) > 20 and max(launches) >= 4
    assert outputs[0] == outputs[1]
    assert [len(tokens) for tokens in outputs[0]] == lengths
    for index in (0, 2, 4, 5):  # greedy: the tokens alone
        assert outputs[0][index] == run(target, None, prompts[index], lengths[index])[0]
    assert breaks[0] == 0
    assert prefill_steps[0] >= 5  # every arrival's prompt (40 tokens: three chunks) ran in some step


def test_speculative_requests_join_the_chain_from_their_prompts_and_speculate_later() -> None:
    """DDTree and linear requests arriving while others run ahead on plain steps (the policy keeps everyone plain):
    their prompts run beside the launched steps, they join the chain with their prompt's drafter context, and once
    speculation is on again they draft from it: their tokens alone."""
    target, drafter = golden_pair()
    prompts = random_prompts(4, target.config.vocab_size, seed=41, lengths=(9, 35, 14))
    references = [run(target, None, p, 26)[0] for p in prompts]
    core = make_core(target, drafter, max_batch=4, prefill_chunk=16, eager_padded=True)
    launches = count_launches(core)
    speculate = {"on": False}
    core.policy.plan = lambda *args, **kwargs: speculate["on"]
    seqs = [make_sequence(target, p, 26, ("ddtree", "linear")[i % 2]) for i, p in enumerate(prompts)]
    breaks = _count_chain_breaks(core)
    core.add(seqs[0])
    for step, seq in ((2, seqs[1]), (5, seqs[2]), (8, seqs[3])):
        while core._step_index < step:
            core.step()
        core.add(seq)
    while core._step_index < 16:
        core.step()
    assert launches and breaks == [0]  # every arrival joined the running chain
    _speculate_to_the_end(core, speculate, seqs, references)
