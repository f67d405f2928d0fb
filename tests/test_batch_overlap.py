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
    arrive while others run ahead (a prompt-cache hit among them) make the core read the launched step first and
    still get their tokens alone; a sampled request in the batch takes the synchronous steps."""
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
