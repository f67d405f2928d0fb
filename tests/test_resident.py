"""Device-resident greedy rounds (`dflash.fastpath.resident`) against the host loops, on the CPU.

On the CPU the runner runs the same round functions eagerly, so these tests check the rounds' arithmetic and the
host side of the queue: tokens equal plain greedy decoding, EOS / max tokens / cancellation inside a queued round,
and the cases that keep the host loop (sampling, suppressed EOS).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from dflash.drafter.model import DFlashDrafter
from dflash.fastpath.dispatch import GraphForwards
from dflash.fastpath.resident import ResidentDecoder
from dflash.fastpath.runner import attach_graph_runner
from dflash.generation.autoregressive import decode_autoregressive
from dflash.generation.forwards import forwards_for, register_forwards
from dflash.generation.output import OutputSink
from dflash.generation.request import GenerationRequest, GenerationStats
from dflash.generation.sampling import SamplingParams
from dflash.generation.selection import TokenChooser
from dflash.models.model import CausalLM
from dflash.speculative.ddtree import decode_ddtree
from dflash.speculative.linear import decode_linear
from tests.spec_helpers import golden_pair, oracle_logits, patch_draft_logits, random_prompts


def generate(
    target: CausalLM, drafter: DFlashDrafter, mode: str, prompt: list[int], max_new: int, *,
    eos: tuple[int, ...] = (), min_tokens: int = 0, sampling: SamplingParams | None = None,
    should_stop: Callable[[], bool] | None = None, num_drafts: int | None = None,
) -> tuple[OutputSink, GenerationStats]:
    sampling = sampling or SamplingParams()
    request = GenerationRequest(prompt_ids=prompt, max_new_tokens=max_new, sampling=sampling, min_tokens=min_tokens)
    sink = OutputSink(lambda ids: "", eos_ids=eos, max_new_tokens=max_new)
    chooser = TokenChooser(sampling, eos_ids=eos, min_tokens=min_tokens, vocab_size=target.config.vocab_size,
                           device="cpu")
    if mode == "plain":
        stats = decode_autoregressive(target, request, sink, chooser, prefill_chunk=32, should_stop=should_stop)
    elif mode.startswith("ddtree:"):
        stats = decode_ddtree(target, drafter, request, sink, chooser, prefill_chunk=32, should_stop=should_stop,
                              budget=int(mode.split(":")[1]))
    else:
        stats = decode_linear(target, drafter, request, sink, chooser, prefill_chunk=32, should_stop=should_stop,
                              num_drafts=num_drafts)
    return sink, stats


@pytest.fixture()
def pair_with_runner():
    target, drafter = golden_pair()
    runner = attach_graph_runner(target, drafter, capacity=1024, capture=False)
    try:
        yield target, drafter, runner
    finally:
        register_forwards(target, None)


def host_loop(target: CausalLM, drafter: DFlashDrafter, *args, **kwargs) -> tuple[OutputSink, GenerationStats]:
    """The same generation with no runner attached: the host-driven loops."""
    forwards = forwards_for(target)
    register_forwards(target, None)
    try:
        return generate(target, drafter, *args, **kwargs)
    finally:
        register_forwards(target, forwards)


@pytest.mark.parametrize(
    ("mode", "num_drafts"), [("plain", None), ("linear", None), ("linear", 4), ("ddtree:6", None), ("ddtree:24", None)]
)
def test_resident_rounds_equal_plain_greedy(pair_with_runner, mode: str, num_drafts: int | None) -> None:
    target, drafter, runner = pair_with_runner
    for prompt in random_prompts(3, target.config.vocab_size, seed=31, lengths=(5, 40, 130)):
        reference, _ = host_loop(target, drafter, "plain", prompt, 70)
        sink, stats = generate(target, drafter, mode, prompt, 70, num_drafts=num_drafts)
        assert sink.token_ids == reference.token_ids
        assert sink.finish_reason == "length"
        if mode != "plain":
            assert stats.rounds > 0 and stats.accepted_tokens + stats.rounds >= 69  # every token counted
    block = drafter.config.block_size
    if mode == "plain":
        key: tuple[object, ...] = (0, None, ())
    elif mode == "linear":
        key = (num_drafts or block - 1, None, tuple(drafter.config.target_layer_ids))
    else:
        budget = int(mode.split(":")[1])
        key = (min(block - 1, budget), budget, tuple(drafter.config.target_layer_ids))
    decoder = runner.residents[key]
    assert isinstance(decoder, ResidentDecoder)
    assert decoder.launched >= 3 * (69 if mode == "plain" else 10)


@pytest.mark.parametrize("mode", ["plain", "linear", "ddtree:8"])
def test_eos_and_max_tokens_inside_a_queued_round(pair_with_runner, mode: str) -> None:
    target, drafter, _ = pair_with_runner
    prompt = random_prompts(1, target.config.vocab_size, seed=32, lengths=(24,))[0]
    plain, _ = host_loop(target, drafter, "plain", prompt, 80)
    eos = (plain.token_ids[37],)  # a token the generation reaches, possibly mid-round
    expected, _ = host_loop(target, drafter, "plain", prompt, 80, eos=eos)
    sink, _ = generate(target, drafter, mode, prompt, 80, eos=eos)
    assert sink.token_ids == expected.token_ids and sink.finish_reason == "stop"
    assert sink.token_ids[-1] == eos[0]
    for max_new in (1, 2, 3, 16, 17):
        sink, _ = generate(target, drafter, mode, prompt, max_new)
        assert sink.token_ids == plain.token_ids[:max_new]


@pytest.mark.parametrize("mode", ["plain", "linear", "ddtree:8"])
def test_suppressed_eos_then_resident_rounds(pair_with_runner, mode: str) -> None:
    """min_tokens: the host loop runs while EOS is suppressed, the resident rounds after; same tokens."""
    target, drafter, _ = pair_with_runner
    prompt = random_prompts(1, target.config.vocab_size, seed=33, lengths=(30,))[0]
    plain, _ = host_loop(target, drafter, "plain", prompt, 60)
    eos = (plain.token_ids[3],)
    expected, _ = host_loop(target, drafter, "plain", prompt, 60, eos=eos, min_tokens=20)
    sink, _ = generate(target, drafter, mode, prompt, 60, eos=eos, min_tokens=20)
    assert sink.token_ids == expected.token_ids
    assert len(sink.token_ids) > 20


@pytest.mark.parametrize("mode", ["plain", "linear", "ddtree:8"])
def test_cancellation_stops_the_queue(pair_with_runner, mode: str) -> None:
    target, drafter, _ = pair_with_runner
    prompt = random_prompts(1, target.config.vocab_size, seed=34, lengths=(20,))[0]
    plain, _ = host_loop(target, drafter, "plain", prompt, 100)
    calls = 0

    def stop_after_some() -> bool:
        nonlocal calls
        calls += 1
        return calls > 8

    sink, _ = generate(target, drafter, mode, prompt, 100, should_stop=stop_after_some)
    assert sink.finish_reason == "cancelled"
    assert 0 < len(sink.token_ids) < 100
    assert sink.token_ids == plain.token_ids[: len(sink.token_ids)]


def test_sampling_keeps_the_host_loop(pair_with_runner) -> None:
    target, drafter, runner = pair_with_runner
    prompt = random_prompts(1, target.config.vocab_size, seed=35, lengths=(20,))[0]
    sink, stats = generate(target, drafter, "linear", prompt, 40, sampling=SamplingParams(temperature=0.8, seed=1))
    assert len(sink.token_ids) == 40 and stats.rounds > 0
    assert runner.residents == {}


def test_capturing_a_round_does_not_advance_the_state(pair_with_runner, monkeypatch) -> None:
    """Capture warms a graph up by running it once; the decoder undoes that run's state changes. Emulated on the
    CPU: the first call per shape runs the round once more before returning it."""
    target, drafter, runner = pair_with_runner
    seen: set[tuple[object, ...]] = set()
    eager_replay = runner.replay

    def replay_with_warm_up(key, build):
        if key not in seen:
            seen.add(key)
            build()  # the warm-up run a capture makes
        runner.capture = False  # then the eager replay of the CPU runner
        try:
            return eager_replay(key, build)
        finally:
            runner.capture = True

    monkeypatch.setattr(runner, "capture", True)
    monkeypatch.setattr(runner, "has_replay", lambda key: key in seen)
    monkeypatch.setattr(runner, "replay", replay_with_warm_up)
    prompt = random_prompts(1, target.config.vocab_size, seed=36, lengths=(20,))[0]
    plain, _ = host_loop(target, drafter, "plain", prompt, 300)
    for mode in ("plain", "linear", "ddtree:12"):
        sink, _ = generate(target, drafter, mode, prompt, 300)  # crosses from the 256 to the 512 bucket
        assert sink.token_ids == plain.token_ids
    assert len({key[2] for key in seen if key[0] == "resident"}) >= 2


@pytest.mark.parametrize("mode", ["linear", "ddtree:6", "ddtree:24"])
def test_accepting_rounds_match_the_host_loop(pair_with_runner, monkeypatch, mode: str) -> None:
    """With a (mostly) right drafter, rounds accept several tokens: the resident rounds commit what the host loop
    commits, round for round (the same trees, walks, compactions and drafter features)."""
    target, drafter, runner = pair_with_runner
    prompt = random_prompts(1, target.config.vocab_size, seed=37, lengths=(30,))[0]
    plain, _ = host_loop(target, drafter, "plain", prompt, 140)
    sequence = prompt + plain.token_ids
    patch_draft_logits(
        monkeypatch, drafter,
        lambda own, tgt, pending, start, *a, **kw: oracle_logits(own(tgt, pending, start, *a, **kw), start, sequence),
    )
    resident_draft = runner.drafter_block_logits
    monkeypatch.setattr(
        runner, "drafter_block_logits",
        lambda bucket, drafts: oracle_logits(resident_draft(bucket, drafts), int(runner.draft_start), sequence),
    )
    reference, host_stats = host_loop(target, drafter, mode, prompt, 120)
    sink, stats = generate(target, drafter, mode, prompt, 120)
    assert reference.token_ids == sink.token_ids == plain.token_ids[:120]
    assert stats.acceptance_length > 2.0
    assert stats.accepted_per_round[:-1] == host_stats.accepted_per_round[: len(stats.accepted_per_round) - 1]
    assert max(runner.residents[key].launched for key in runner.residents) > 5


def test_absorbed_context_drafts_what_one_round_drafts() -> None:
    """Writing the prompt's context rows first (`absorb_context`) and running the round over the rest gives the
    round's logits and cache rows of one round over every row."""
    target, drafter = golden_pair()
    generator = torch.Generator().manual_seed(5)
    features = torch.randn(1, 40, drafter.config.feature_size, generator=generator)  # [1, 40, n*hidden]
    whole, split = drafter.new_cache(64), drafter.new_cache(64)
    one_round = drafter.draft_scores(target, 7, 40, features, whole).full()  # [B-1, vocab]
    drafter.absorb_context(features[:, :33], torch.arange(33)[None], split)
    assert split.length == 33
    after_absorbing = drafter.draft_scores(target, 7, 40, features[:, 33:], split).full()
    assert whole.length == split.length == 40
    torch.testing.assert_close(after_absorbing, one_round, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(split.keys[:, :, :, :40], whole.keys[:, :, :, :40], rtol=1e-5, atol=1e-5)
    assert torch.equal(split.positions[:, :40], whole.positions[:, :40])


@pytest.mark.parametrize("mode", ["linear", "ddtree:8"])
def test_long_prompts_go_straight_to_resident_rounds(pair_with_runner, monkeypatch, mode: str) -> None:
    """A prompt longer than the drafter's block needs no host-driven first round: its context rows are absorbed
    and every round is a resident one."""
    target, drafter, _ = pair_with_runner
    prompt = random_prompts(1, target.config.vocab_size, seed=38, lengths=(150,))[0]
    reference, _ = host_loop(target, drafter, "plain", prompt, 50)

    def no_host_round(*args: object, **kwargs: object) -> torch.Tensor:
        raise AssertionError("a host-driven drafter round ran")

    monkeypatch.setattr(GraphForwards, "draft_scores", no_host_round)  # graphed or eager
    sink, stats = generate(target, drafter, mode, prompt, 50)
    assert sink.token_ids == reference.token_ids
    assert stats.rounds > 0
