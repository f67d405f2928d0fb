"""The batched core: a request's output is the same alone and in any batch (greedy, float32), sampling keeps the
target's distribution per request, and cancellations, prefix-cache hits, late arrivals and failures stay per
request."""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

from dflash.batch import core as core_module
from dflash.batch.draft_pass import DraftRows
from dflash.batch.sequence import Sequence
from dflash.drafter.vocab import DraftScores
from dflash.errors import GenerationError
from dflash.generation.sampling import SamplingParams
from dflash.kv.prefix_cache import PrefixCache
from tests.batch_helpers import drain, make_core, make_sequence, sampled_counts
from tests.spec_helpers import (
    golden_pair,
    one_torch_thread,
    oracle_logits,
    random_prompts,
    run,
    tiny_random_pair,
    total_variation,
)

_one_thread = one_torch_thread  # autouse, module scope

MODES = ("none", "linear", "ddtree")


def _reference(prompt: list[int], max_new: int) -> list[int]:
    target, _ = golden_pair()
    return run(target, None, prompt, max_new)[0]


def _install_oracle(monkeypatch: pytest.MonkeyPatch, references: dict[int, list[int]]) -> None:
    """Make the drafter mostly right: for the sequence whose drafter table is keyed in `references` (prompt and
    greedy output), put the right token on top at most draft rows, second behind a wrong one at some (so linear
    rounds stop early and trees continue through a non-first child)."""
    real = core_module.run_drafter

    def oracle(drafter: Any, target: Any, pool: Any, items: list[DraftRows], graphs: Any = None) -> list[DraftScores]:
        scores = real(drafter, target, pool, items, graphs)
        patched = []
        for item, score in zip(items, scores, strict=True):
            logits = oracle_logits(score.full(), item.start, references[id(item.table)])  # [outputs, vocab]
            patched.append(DraftScores(logits, None, logits.shape[1]))
        return patched

    monkeypatch.setattr(core_module, "run_drafter", oracle)


def test_a_greedy_request_gives_the_same_tokens_alone_and_in_a_mixed_batch() -> None:
    """Seven requests of 5-100 prompt tokens (chunks of 32: some prefill over several steps while others decode),
    plain, linear and DDTree mixed, at most three decoding together: each equals plain decoding alone."""
    target, drafter = golden_pair()
    prompts = random_prompts(7, target.config.vocab_size, seed=11, lengths=(5, 100, 33, 64, 17, 71, 9))
    core = make_core(target, drafter, max_batch=3, prefill_chunk=32)
    seqs = [make_sequence(target, p, 30, MODES[i % 3]) for i, p in enumerate(prompts)]
    for seq in seqs:
        core.add(seq)
    drain(core)
    for seq, prompt in zip(seqs, prompts, strict=True):
        assert seq.error is None and seq.sink.finish_reason == "length"
        assert seq.sink.token_ids == _reference(prompt, 30), seq.mode
    assert core.target_pool.free_blocks == core.target_pool.num_blocks  # every block came back


def _always_speculate(core: Any) -> Any:
    core.policy.plan = lambda *args, **kwargs: True  # its timing of real steps must not change the rounds' rows
    core.tree_budgets.forced = True
    return core


@pytest.mark.parametrize("eager_padded", [False, True], ids=["packed", "padded"])
def test_a_seeded_sampled_request_gives_the_same_tokens_alone_and_in_a_batch(eager_padded: bool) -> None:
    """Sampled requests choose on the device and the step reads every request's choices back at once: each seeded
    request (plain, linear, DDTree; temperature 0.8, top-p 0.9) gives the tokens it gives alone, beside greedy
    requests of every mode."""
    target, drafter = golden_pair()
    prompts = random_prompts(6, target.config.vocab_size, seed=41, lengths=(8, 30, 19))
    modes = ("none", "linear", "ddtree", "ddtree", "none", "linear")

    def sequence(index: int) -> Sequence:
        sampled = SamplingParams(temperature=0.8, top_p=0.9, seed=100 + index) if index % 2 == 0 else None
        return make_sequence(target, prompts[index], 20, modes[index], sampling=sampled)

    alone = []
    for index in range(len(prompts)):
        core = _always_speculate(make_core(target, drafter, max_batch=1, eager_padded=eager_padded))
        seq = sequence(index)
        core.add(seq)
        drain(core)
        alone.append(seq.sink.token_ids)
    core = _always_speculate(make_core(target, drafter, max_batch=6, eager_padded=eager_padded))
    seqs = [sequence(index) for index in range(len(prompts))]
    for seq in seqs:
        core.add(seq)
    drain(core)
    for index, seq in enumerate(seqs):
        assert seq.error is None and len(seq.sink.token_ids) == 20
        assert seq.sink.token_ids == alone[index], (index, seq.mode)
    assert alone[0] != _reference(prompts[0], 20)  # (it did sample)


class _HostReads(TorchFunctionMode):
    """Counts the tensor reads to Python (each a synchronisation with a GPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if getattr(func, "__name__", "") in ("tolist", "item", "__int__", "__float__", "__bool__", "cpu"):
            self.reads += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("eager_padded", [False, True], ids=["packed", "padded"])
def test_a_step_reads_every_sampled_choice_back_at_once(eager_padded: bool) -> None:
    """A decoding step of 2 or 6 sampled plain requests reads tensors to the host as often (the choices of all of
    them in one transfer; through the padded passes, the step launched before it), and its tokens are each
    request's own (seeded: the same as alone)."""
    target, _ = golden_pair()
    reads = []
    for count in (2, 6):
        core = make_core(target, None, max_batch=count, eager_padded=eager_padded)
        sampling = [SamplingParams(temperature=1.0, seed=index) for index in range(count)]
        seqs = [make_sequence(target, [1, 2, 3], 8, "none", sampling=s) for s in sampling]
        for seq in seqs:
            core.add(seq)
        while any(seq.phase != "decode" for seq in seqs):
            core.step()
        core.step()  # through the padded passes the first decoding step is launched ahead, read by the next one
        counter = _HostReads()
        with counter:
            assert core.step() == count
        reads.append(counter.reads)
        drain(core)
        assert [seq.sink.token_ids for seq in seqs[:2]] == [
            _sampled_alone(target, s, eager_padded) for s in sampling[:2]
        ]
    assert reads[0] == reads[1] == 1, reads


def _sampled_alone(target: Any, sampling: SamplingParams, eager_padded: bool) -> list[int]:
    core = make_core(target, None, max_batch=1, eager_padded=eager_padded)
    seq = make_sequence(target, [1, 2, 3], 8, "none", sampling=sampling)
    core.add(seq)
    drain(core)
    return seq.sink.token_ids


def test_accepted_drafts_and_tree_paths_commit_exactly_in_a_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a mostly right drafter, linear and DDTree requests accept several drafts per round and trees keep
    paths through non-first children (K/V compaction per request), while plain requests share the steps."""
    target, drafter = golden_pair()
    prompts = random_prompts(6, target.config.vocab_size, seed=12, lengths=(12, 40, 70))
    references = {i: _reference(p, 48) for i, p in enumerate(prompts)}
    core = make_core(target, drafter, max_batch=6, ddtree_budget=12)
    seqs = [make_sequence(target, p, 48, ("linear", "ddtree", "none")[i % 3]) for i, p in enumerate(prompts)]
    for seq in seqs:
        core.add(seq)
    core.step()  # admits every request (their drafter tables exist from here on)
    by_table = {id(s.drafter): prompts[i] + references[i] for i, s in enumerate(seqs) if s.drafter is not None}
    _install_oracle(monkeypatch, by_table)
    drain(core)
    for i, seq in enumerate(seqs):
        assert seq.sink.token_ids == references[i], seq.mode
        if seq.mode != "none":
            assert seq.stats.acceptance_length > 2.5, (seq.mode, seq.stats.acceptance_length)


def test_requests_joining_mid_generation_do_not_change_anyone_s_output() -> None:
    target, drafter = golden_pair()
    prompts = random_prompts(6, target.config.vocab_size, seed=13, lengths=(20, 50))
    core = make_core(target, drafter, max_batch=8, prefill_chunk=16)
    seqs = [make_sequence(target, p, 24, MODES[i % 3]) for i, p in enumerate(prompts)]
    for index, seq in enumerate(seqs):
        core.add(seq)
        for _ in range(index + 2):  # the earlier ones are prefilling or decoding when the next arrives
            core.step()
    drain(core)
    for seq, prompt in zip(seqs, prompts, strict=True):
        assert seq.sink.token_ids == _reference(prompt, 24)


def test_cancellation_ends_one_request_within_a_step_and_frees_its_memory() -> None:
    target, drafter = golden_pair()
    prompts = random_prompts(4, target.config.vocab_size, seed=14, lengths=(30, 120))
    core = make_core(target, drafter, max_batch=4, prefill_chunk=16)
    stops = {"decode": False, "prefill": False}
    seqs = [
        make_sequence(target, prompts[0], 40, "ddtree", should_stop=lambda: stops["decode"]),
        make_sequence(target, prompts[1], 40, "linear", should_stop=lambda: stops["prefill"]),  # 120-token prompt
        make_sequence(target, prompts[2], 40, "linear"),
        make_sequence(target, prompts[3], 40, "none"),
    ]
    for seq in seqs:
        core.add(seq)
    for _ in range(6):
        core.step()
    assert seqs[0].phase == "decode" and seqs[1].phase == "prefill"
    stops["decode"] = stops["prefill"] = True
    core.step()
    assert seqs[0].done.is_set() and seqs[1].done.is_set()
    assert seqs[0].sink.finish_reason == seqs[1].sink.finish_reason == "cancelled"
    assert 0 < seqs[0].produced < 40 and seqs[1].produced == 0
    drain(core)
    for seq, prompt in zip(seqs[2:], prompts[2:], strict=True):
        assert seq.sink.token_ids == _reference(prompt, 40)
    assert core.target_pool.free_blocks == core.target_pool.num_blocks
    assert core.drafter_pool is not None and core.drafter_pool.free_blocks == core.drafter_pool.num_blocks


def test_prefix_cache_hits_inside_a_batch_keep_outputs_exact() -> None:
    """Requests sharing a 64-token prefix: the later ones restore its blocks (target K/V and features) from the
    prefix cache while others decode; every output equals a cold plain run."""
    target, drafter = golden_pair()
    shared = random_prompts(1, target.config.vocab_size, seed=15, lengths=(64,))[0]
    tails = random_prompts(6, target.config.vocab_size, seed=16, lengths=(5, 40))
    cache = PrefixCache(64 * 2**20, block_tokens=32, feature_layers=drafter.config.target_layer_ids)
    core = make_core(target, drafter, max_batch=4, prefill_chunk=32, prefix_cache=cache)
    first = make_sequence(target, shared + tails[0], 20, "ddtree")
    core.add(first)
    drain(core)
    later = [make_sequence(target, shared + tail, 20, MODES[i % 3]) for i, tail in enumerate(tails[1:])]
    for seq in later:
        core.add(seq)
    drain(core)
    for seq in [first, *later]:
        assert seq.sink.token_ids == _reference(seq.request.prompt_ids, 20)
    assert first.stats.cached_tokens == 0
    assert all(seq.stats.cached_tokens == 64 for seq in later)


def test_memory_decides_admission_and_an_impossible_request_is_refused() -> None:
    target, drafter = golden_pair()
    core = make_core(target, drafter, max_batch=8, pool_tokens=160)
    prompts = random_prompts(3, target.config.vocab_size, seed=17, lengths=(40,))
    seqs = [make_sequence(target, p, 30, "linear") for p in prompts]
    for seq in seqs:
        core.add(seq)
    core.step()
    assert len(core.active) == 1 and len(core.waiting) == 2  # one request's reservation fills most of the pool
    drain(core)
    for seq, prompt in zip(seqs, prompts, strict=True):
        assert seq.sink.token_ids == _reference(prompt, 30)
    with pytest.raises(GenerationError, match="K/V memory"):
        core.add(make_sequence(target, prompts[0], 200, "none"))


def test_a_failing_output_callback_ends_only_its_own_request() -> None:
    target, drafter = golden_pair()
    prompts = random_prompts(3, target.config.vocab_size, seed=18, lengths=(10,))
    core = make_core(target, drafter)
    seqs = [make_sequence(target, p, 20, MODES[i]) for i, p in enumerate(prompts)]

    def broken(text: str, ids: list[int]) -> None:
        raise RuntimeError("client callback broke")

    seqs[1].sink.on_text = broken
    for seq in seqs:
        core.add(seq)
    drain(core)
    assert isinstance(seqs[1].error, RuntimeError)
    with pytest.raises(RuntimeError, match="client callback broke"):
        seqs[1].result()
    for index in (0, 2):
        assert seqs[index].sink.token_ids == _reference(prompts[index], 20)


# ---- sampling ------------------------------------------------------------------------------------------------

VOCAB, BLOCK, NEW = 8, 4, 4


def _batched_samples(mode: str, samples: int, budget: int = 6) -> list[Counter[int]]:
    """`samples` requests with seeds 0.. sampled at temperature 1, 64 in a batch: token counts per position."""
    return sampled_counts(*tiny_random_pair(VOCAB, 2.0, BLOCK), mode, samples, NEW, budget=budget, block=BLOCK)



@pytest.mark.slow
def test_sampling_in_a_batch_keeps_each_request_s_target_distribution(monkeypatch: pytest.MonkeyPatch) -> None:
    """Per-position token distributions of 1500 sampled requests (64 per batch) in DDTree and linear mode agree with
    plain decoding's within TV 0.06; a control whose tree walk accepts the first child whatever the target chose
    exceeds it (the test can fail)."""
    samples, tolerance = 1500, 0.06
    reference = _batched_samples("none", samples)
    for mode in ("ddtree", "linear"):
        distances = [total_variation(p, s) for p, s in zip(reference, _batched_samples(mode, samples), strict=True)]
        assert max(distances) < tolerance, (mode, distances)
    original = core_module.follow_tree

    def broken(tree: Any, posterior: Any) -> tuple[list[int], int]:
        if tree.num_nodes == 0:
            return original(tree, posterior)
        return [0, 1], int(posterior[1])

    monkeypatch.setattr(core_module, "follow_tree", broken)
    control = [total_variation(p, s) for p, s in zip(reference, _batched_samples("ddtree", samples), strict=True)]
    assert max(control) > tolerance, control


def test_sequences_report_their_own_errors_through_result() -> None:
    target, _ = golden_pair()
    seq: Sequence = make_sequence(target, [1, 2], 4, "none")
    seq.finish(GenerationError("boom"))
    with pytest.raises(GenerationError, match="boom"):
        seq.result()
    assert torch.equal(torch.tensor(seq.sink.token_ids, dtype=torch.long), torch.empty(0, dtype=torch.long))


def test_a_prompt_s_time_runs_until_its_first_token_is_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """`prefill_s` ends when the first token is on the host, not when the prompt's passes were queued (on a GPU the
    queuing is a fraction of the work): a first token that takes 50 ms to reach the host counts in it."""
    from dflash.batch.prompt_steps import PromptSteps

    target, _ = golden_pair()
    start = PromptSteps._start_decoding

    def slow_read(self: Any, seq: Sequence, first: int) -> None:
        time.sleep(0.05)  # the read of the first token waiting for the device
        start(self, seq, first)

    monkeypatch.setattr(PromptSteps, "_start_decoding", slow_read)
    core = make_core(target, None)
    seq = make_sequence(target, random_prompts(1, target.config.vocab_size, seed=5, lengths=(12,))[0], 3, "none")
    core.add(seq)
    drain(core)
    assert seq.error is None and seq.stats.prefill_s >= 0.05
