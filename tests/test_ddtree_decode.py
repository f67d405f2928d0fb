"""DDTree decoding (dflash.speculative.ddtree) is lossless and keeps the target cache and the drafter in step.

Greedy output equals plain greedy output for several budgets (also with min_tokens and a sliding-window target);
a chain-shaped tree is linear DFlash round for round; a mostly right drafter gets deep, branching paths accepted;
after compaction the target cache and the drafter's features equal a fresh forward over the committed sequence;
sampling keeps the target's distribution (with a broken-rule control that must fail); a seed fixes the output.

Two pairs: the golden tiny Qwen3 target with its random DFlash drafter (1024 tokens, block 16), and a "peaky" 8-token
target with a random block-4 drafter, small enough to verify the full tree of every depth-3 prefix.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from functools import cache
from typing import Any

import pytest
import torch

import dflash.speculative.ddtree as ddtree
from dflash.drafter.model import DFlashDrafter, DrafterConfig
from dflash.generation.autoregressive import decode_autoregressive
from dflash.generation.output import OutputSink
from dflash.generation.request import GenerationRequest, GenerationStats
from dflash.generation.sampling import SamplingParams
from dflash.generation.selection import TokenChooser
from dflash.kv.cache import KVCache
from dflash.models.model import CausalLM
from dflash.speculative.ddtree import decode_ddtree
from dflash.speculative.gate import SpeculationGate
from dflash.speculative.tree import DraftTree, linear_chain_tree
from tests.spec_helpers import (
    golden_pair,
    one_torch_thread,
    patch_draft_logits,
    random_prompts,
    run,
    tiny_random_pair,
    total_variation,
)
from tests.tiny_models import hf_tiny, ours_from_hf

LENGTHS = (3, 17, 64, 65, 130, 257)  # short, around and beyond the prefill chunk of 64
VOCAB = 8  # the peaky pair's vocabulary
PEAKY_BLOCK = 4  # the peaky drafter's block: trees up to depth 3
FULL_TREE = VOCAB + VOCAB**2 + VOCAB**3  # every prefix of depth <= 3: the walk always reaches depth 3


_one_thread = one_torch_thread  # autouse, module scope


def run_ddtree(
    target: CausalLM,
    drafter: DFlashDrafter,
    prompt: list[int],
    max_new: int,
    *,
    budget: int,
    sampling: SamplingParams | None = None,
    eos: tuple[int, ...] = (),
    min_tokens: int = 0,
    prefill_chunk: int = 64,
    seed_top1_chain: bool = False,
    sink: OutputSink | None = None,
    should_stop: Callable[[], bool] | None = None,
    gate: SpeculationGate | None = None,
) -> tuple[list[int], GenerationStats]:
    sampling = sampling or SamplingParams()
    request = GenerationRequest(prompt_ids=prompt, max_new_tokens=max_new, sampling=sampling, min_tokens=min_tokens)
    sink = sink or OutputSink(lambda ids: "", eos_ids=eos, max_new_tokens=max_new)
    chooser = TokenChooser(
        sampling, eos_ids=eos, min_tokens=min_tokens, vocab_size=target.config.vocab_size, device="cpu"
    )
    stats = decode_ddtree(
        target, drafter, request, sink, chooser, prefill_chunk=prefill_chunk, budget=budget,
        seed_top1_chain=seed_top1_chain, should_stop=should_stop, gate=gate,
    )
    return sink.token_ids, stats


def run_plain(
    target: CausalLM, prompt: list[int], max_new: int, *, eos: tuple[int, ...] = (), min_tokens: int = 0
) -> list[int]:
    sampling = SamplingParams()
    request = GenerationRequest(prompt_ids=prompt, max_new_tokens=max_new, sampling=sampling, min_tokens=min_tokens)
    sink = OutputSink(lambda ids: "", eos_ids=eos, max_new_tokens=max_new)
    chooser = TokenChooser(
        sampling, eos_ids=eos, min_tokens=min_tokens, vocab_size=target.config.vocab_size, device="cpu"
    )
    decode_autoregressive(target, request, sink, chooser, prefill_chunk=64)
    return sink.token_ids


def _tiny_pair(embed_scale: float) -> tuple[CausalLM, DFlashDrafter]:
    """An 8-token llama target and a random block-4 drafter (`tiny_random_pair`)."""
    return tiny_random_pair(VOCAB, embed_scale, PEAKY_BLOCK)


@cache
def peaky_pair() -> tuple[CausalLM, DFlashDrafter]:
    """Scale 60: the target's top token has probability ~1 (sampling is practically greedy)."""
    return _tiny_pair(60.0)


@cache
def spread_pair() -> tuple[CausalLM, DFlashDrafter]:
    """Scale 2: top-token probabilities of about 0.4-0.65, entropy about 1.4 nats, so sampling really varies."""
    return _tiny_pair(2.0)


def install_oracle(monkeypatch: pytest.MonkeyPatch, drafter: DFlashDrafter, sequence: Sequence[int]) -> None:
    """Make the drafter (mostly) right: `sequence` is the greedy output (prompt included), so its token at a
    position is what the target will choose there. The real drafter still runs (its cache stays in step); its
    logits get the right token on top, except at some (position, round) pairs where a wrong token is put first
    and the right one second: linear DFlash then stops there, while a tree that also holds the runner-up
    continues through a non-first child."""
    def oracle(original: Any, tgt: Any, pending: int, start: int, new_features: torch.Tensor, cache: Any,
               **kw: Any) -> torch.Tensor:
        logits = original(tgt, pending, start, new_features, cache, **kw).clone()  # [B-1, vocab]
        vocab = logits.shape[1]
        for row in range(logits.shape[0]):
            position = start + 1 + row
            if position >= len(sequence):
                break
            right = sequence[position]
            top = float(logits[row].max())
            if (position * 31 + start * 17) % 7 in (0, 3):  # this round drafts a wrong token here, the right one second
                logits[row, (right + 1) % vocab] = top + 6.0
                logits[row, right] = top + 5.5
            else:
                logits[row, right] = top + 6.0
        return logits

    patch_draft_logits(monkeypatch, drafter, oracle)


# ---- greedy: lossless ----------------------------------------------------------------------------------------

GOLDEN_PROMPTS = random_prompts(30, 1000, seed=11, lengths=LENGTHS)


@cache
def golden_plain(index: int) -> tuple[int, ...]:
    target, _ = golden_pair()
    return tuple(run(target, None, GOLDEN_PROMPTS[index], 128)[0])


def _check_lossless_golden(budget: int, indices: Sequence[int]) -> int:
    """DDTree == plain greedy on the given golden prompts; returns the number of rounds that accepted drafts."""
    target, drafter = golden_pair()
    accepted_rounds = 0
    for index in indices:
        tokens, stats = run_ddtree(target, drafter, GOLDEN_PROMPTS[index], 128, budget=budget)
        assert tuple(tokens) == golden_plain(index), (budget, index)
        assert stats.rounds == len(stats.accepted_per_round) and stats.draft_tokens <= budget * stats.rounds
        assert stats.accepted_tokens + stats.rounds + 1 >= len(tokens)  # +1: the prefill's token
        accepted_rounds += sum(1 for a in stats.accepted_per_round if a > 0)
    return accepted_rounds


def test_greedy_ddtree_equals_plain_greedy_on_30_prompts() -> None:
    """Budget 16 (the engine default) on all 30 prompts; budgets 4 and 64 on the first 6 (one of each length). The
    slow test below runs budgets 4 and 64 on the other 24."""
    accepted = _check_lossless_golden(16, range(30))
    accepted += _check_lossless_golden(4, range(6))
    accepted += _check_lossless_golden(64, range(6))
    assert accepted > 0  # the multi-token path (and the compaction of a non-prefix path) was exercised


@pytest.mark.slow
@pytest.mark.parametrize("budget", [4, 64])
def test_greedy_ddtree_equals_plain_greedy_remaining_prompts(budget: int) -> None:
    _check_lossless_golden(budget, range(6, 30))


def test_budget_zero_is_plain_decoding(monkeypatch: pytest.MonkeyPatch) -> None:
    target, drafter = golden_pair()

    def no_drafting(*args: Any, **kwargs: Any) -> torch.Tensor:
        raise AssertionError("budget 0 must not run the drafter")

    monkeypatch.setattr(drafter, "draft_scores", no_drafting)
    prompt = GOLDEN_PROMPTS[1]
    tokens, stats = run_ddtree(target, drafter, prompt, 40, budget=0)
    assert tuple(tokens) == tuple(run(target, None, prompt, 40)[0])
    assert stats.rounds == 39 and stats.accepted_tokens == 0 and stats.draft_tokens == 0


def test_cancellation_during_prefill_and_decoding() -> None:
    target, drafter = golden_pair()
    prompt = GOLDEN_PROMPTS[5]  # 257 tokens: five prefill chunks of 64
    calls = 0

    def stop_after(n: int) -> Callable[[], bool]:
        def should_stop() -> bool:
            nonlocal calls
            calls += 1
            return calls > n

        return should_stop

    sink = OutputSink(lambda ids: "", eos_ids=(), max_new_tokens=64)
    tokens, stats = run_ddtree(target, drafter, prompt, 64, budget=16, sink=sink, should_stop=stop_after(2))
    assert tokens == [] and sink.finish_reason == "cancelled" and stats.rounds == 0
    calls = 0
    sink = OutputSink(lambda ids: "", eos_ids=(), max_new_tokens=64)
    tokens, stats = run_ddtree(target, drafter, prompt, 64, budget=16, sink=sink, should_stop=stop_after(5 + 3))
    assert sink.finish_reason == "cancelled" and stats.rounds == 3  # five prefill checks, then three rounds
    assert tokens == list(golden_plain(5)[: len(tokens)])


def test_full_tree_always_accepts_the_whole_depth() -> None:
    """With every prefix in the tree the target's choice is always a child: each round commits depth + 1 tokens."""
    target, drafter = peaky_pair()
    for prompt in ([1, 2, 3], [4, 5, 6, 7, 1, 0, 2], [6] * 30):
        for max_new in (1, 2, 5, 40):
            tokens, stats = run_ddtree(target, drafter, prompt, max_new, budget=FULL_TREE)
            assert tokens == run_plain(target, prompt, max_new)
            full_rounds, last = divmod(max_new - 1, PEAKY_BLOCK)
            expected = [PEAKY_BLOCK - 1] * full_rounds + ([last - 1] if last else [])
            assert stats.accepted_per_round == expected, (prompt, max_new)


def test_min_tokens_suppresses_eos_at_each_nodes_own_output_index() -> None:
    """A depth-d node decides output token produced + d: EOS suppression must follow depth, not row order.

    EOS is a token that plain greedy decoding emits at output index k, suppressed until k+1 or k+4; a mostly right
    drafter makes the trees reach the suppressed positions through nodes numbered past their depth."""
    target, drafter = golden_pair()
    max_new = 40
    cases = 0
    for index in (0, 1, 3, 9):
        prompt = GOLDEN_PROMPTS[index]
        free = run_plain(target, prompt, max_new)
        for k in (1, 3, 6, 10):
            if free[k] in free[:k]:
                continue
            eos = (free[k],)
            for min_tokens in (k + 1, k + 4):
                plain = run_plain(target, prompt, max_new + 16, eos=eos, min_tokens=min_tokens)
                assert plain[k] != free[k]
                with pytest.MonkeyPatch.context() as mp:
                    install_oracle(mp, drafter, prompt + plain)
                    for budget in (4, 16):
                        tokens, _ = run_ddtree(
                            target, drafter, prompt, max_new, budget=budget, eos=eos, min_tokens=min_tokens
                        )
                        assert tokens == plain[:max_new], (index, k, min_tokens, budget)
                cases += 1
    assert cases >= 10


def test_sliding_window_target_stays_lossless() -> None:
    """Gemma 3 (sliding-window layers, window 16): the tree mask is combined with the window by position."""
    target = ours_from_hf(hf_tiny("gemma3", seed=5))
    vocab = target.config.vocab_size
    config_raw = {
        "num_hidden_layers": 1, "num_target_layers": 4, "hidden_size": 64, "intermediate_size": 64,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": vocab,
        "block_size": 8, "dflash_config": {"mask_token_id": vocab - 1, "target_layer_ids": [1, 2]},
    }
    torch.manual_seed(9)
    drafter = DFlashDrafter(DrafterConfig.from_dict(config_raw)).eval().requires_grad_(False)
    for prompt in random_prompts(3, vocab, seed=21, lengths=(5, 23, 40)):
        plain = run_plain(target, prompt, 48)
        for budget in (7, 24):
            tokens, _ = run_ddtree(target, drafter, prompt, 48, budget=budget, prefill_chunk=16)
            assert tokens == plain, (len(prompt), budget)


# ---- a chain is linear DFlash ------------------------------------------------------------------------------


def _same_rounds_as_linear(
    tree_stats: GenerationStats, linear_stats: GenerationStats, block_size: int, max_new: int
) -> None:
    """Same acceptance in every round until the tree is cut short by max_new_tokens (from there on a budget wider
    than the remaining depth branches out, so only the tokens are compared)."""
    ours, theirs = tree_stats.accepted_per_round, linear_stats.accepted_per_round
    produced, compared = 1, 0  # the prefill gives the first token
    for mine, linear in zip(ours, theirs, strict=False):
        if produced > max_new - block_size:
            break
        assert mine == linear, (compared, ours, theirs)
        produced += mine + 1
        compared += 1
    assert compared >= len(theirs) - block_size


def _chain(draft_logits: torch.Tensor, budget: int, *, token_ids: torch.Tensor | None = None, **kw: Any) -> DraftTree:
    """A builder that returns the drafter's argmax chain (needs a budget of at least the depth)."""
    assert budget >= draft_logits.shape[0]
    best = draft_logits.argmax(dim=-1)  # [depth] columns
    return linear_chain_tree((best if token_ids is None else token_ids[best]).tolist())


@pytest.mark.parametrize("pair", ["golden", "peaky"])
def test_top1_chain_tree_matches_linear_round_for_round(pair: str) -> None:
    """(a) budget = B-1 with seed_top1_chain (the builder fills the budget with the top-1 chain) and (b) any builder
    replaced by the argmax chain give linear DFlash's tokens and per-round acceptances."""
    target, drafter = golden_pair() if pair == "golden" else peaky_pair()
    depth = drafter.config.block_size - 1
    if pair == "golden":  # prompt 14 is accepted now and then by the random drafter itself
        cases = [(GOLDEN_PROMPTS[14], False), (GOLDEN_PROMPTS[0], True), (GOLDEN_PROMPTS[4], True)]
        max_new = 128
    else:
        cases = [([1, 2, 3], True), ([4, 5, 6, 7, 1, 0, 2], True), ([0, 5, 2, 2], False)]
        max_new = 60
    linear_accepted = 0
    for prompt, oracle in cases:
        with pytest.MonkeyPatch.context() as mp:
            if oracle:
                install_oracle(mp, drafter, prompt + run(target, None, prompt, max_new + depth + 1)[0])
            lin_tokens, lin_stats = run(target, drafter, prompt, max_new)
            tokens, stats = run_ddtree(target, drafter, prompt, max_new, budget=depth, seed_top1_chain=True)
            assert tokens == lin_tokens
            _same_rounds_as_linear(stats, lin_stats, depth + 1, max_new)
            assert stats.draft_tokens <= lin_stats.draft_tokens
            mp.setattr(ddtree, "build_tree", _chain)
            tokens, stats = run_ddtree(target, drafter, prompt, max_new, budget=64)
            assert tokens == lin_tokens
            _same_rounds_as_linear(stats, lin_stats, depth + 1, max_new)
        linear_accepted += lin_stats.accepted_tokens
    assert linear_accepted > 10  # the comparison covers rounds that accept drafts


def test_mostly_right_drafter_accepts_deep_branching_paths() -> None:
    """With a mostly right drafter the trees accept long paths, some through a runner-up child, stay lossless, and
    accept more than linear DFlash with the same drafter."""
    target, drafter = golden_pair()
    depth = drafter.config.block_size - 1
    max_new = 96
    paths: list[list[int]] = []
    original_follow = ddtree.follow_tree

    def spy_follow(tree: DraftTree, posterior: Any) -> tuple[list[int], int]:
        visited, bonus = original_follow(tree, posterior)
        paths.append(visited)
        return visited, bonus

    linear_rounds, tree_rounds = 0, {4: 0, 16: 0}  # every run commits max_new tokens: fewer rounds = more accepted
    for index in (0, 3, 5):  # prompt lengths 3, 65, 257
        prompt = GOLDEN_PROMPTS[index]
        plain = run(target, None, prompt, max_new + depth + 1)[0]
        with pytest.MonkeyPatch.context() as mp:
            install_oracle(mp, drafter, prompt + plain)
            lin_tokens, lin_stats = run(target, drafter, prompt, max_new)
            assert lin_tokens == plain[:max_new]
            linear_rounds += lin_stats.rounds
            mp.setattr(ddtree, "follow_tree", spy_follow)
            for budget in tree_rounds:
                tokens, stats = run_ddtree(target, drafter, prompt, max_new, budget=budget)
                assert tokens == plain[:max_new], (index, budget)
                tree_rounds[budget] += stats.rounds
    assert 3 * tree_rounds[16] < 2 * linear_rounds  # 42 rounds against 83 for linear DFlash here
    assert tree_rounds[4] <= linear_rounds
    assert max(len(p) for p in paths) >= 7
    assert any(len(p) > 3 and p != list(range(len(p))) for p in paths)  # deep path through a non-first child


# ---- the target cache after compaction, and the drafter's context ---------------------------------------------


class _SnapshotSink(OutputSink):
    """Records (committed tokens before the round, cache length, K, V, positions) whenever a round commits."""

    def __init__(self, max_new: int, caches: list[KVCache]) -> None:
        super().__init__(lambda ids: "", eos_ids=(), max_new_tokens=max_new)
        self.caches = caches
        self.snapshots: list[tuple[list[int], list[int], int, torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def push_many(self, tokens: Sequence[int]) -> bool:
        cache = self.caches[0]
        n = cache.length
        self.snapshots.append((
            list(self.token_ids), list(tokens), n,
            cache.keys[..., :n, :].clone(), cache.values[..., :n, :].clone(), cache.positions[:, :n].clone(),
        ))
        return super().push_many(tokens)


@pytest.mark.parametrize(
    ("pair", "budget", "temperature"),
    [("spread", FULL_TREE, 1.0), ("spread", 9, 1.0), ("peaky", FULL_TREE, 0.0), ("golden", 64, 0.0),
     ("golden-oracle", 16, 0.0)],
)
def test_compacted_cache_equals_a_fresh_prefill(
    pair: str, budget: int, temperature: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After every round the target cache slots [0, start) equal a fresh prefill of the committed sequence."""
    target, drafter = golden_pair() if pair.startswith("golden") else (peaky_pair() if pair == "peaky" else spread_pair())
    prompt = GOLDEN_PROMPTS[8] if pair.startswith("golden") else [1, 2, 3, 4, 5]
    max_new = 128 if pair.startswith("golden") else 40
    if pair == "golden-oracle":
        install_oracle(monkeypatch, drafter, prompt + run(target, None, prompt, max_new + 16)[0])
    caches: list[KVCache] = []
    original_new_cache = target.new_cache

    def spy_new_cache(capacity: int, batch: int = 1) -> KVCache:
        made = original_new_cache(capacity, batch)
        caches.append(made)
        return made

    paths: list[list[int]] = []
    original_follow = ddtree.follow_tree

    def spy_follow(tree: DraftTree, posterior: Any) -> tuple[list[int], int]:
        visited, bonus = original_follow(tree, posterior)
        paths.append(visited)
        return visited, bonus

    monkeypatch.setattr(target, "new_cache", spy_new_cache)
    monkeypatch.setattr(ddtree, "follow_tree", spy_follow)
    sink = _SnapshotSink(max_new, caches)
    sampling = SamplingParams(temperature=temperature, seed=5)
    run_ddtree(target, drafter, prompt, max_new, budget=budget, sampling=sampling, sink=sink)
    monkeypatch.undo()

    assert len(caches) == 1 and len(sink.snapshots) == len(paths)
    assert any(len(p) > 1 and p != list(range(len(p))) for p in paths)  # a path that needed real compaction
    for (before, committed, length, keys, values, positions), path in zip(sink.snapshots, paths, strict=True):
        # the cache holds the prompt, the tokens committed before this round and this round's path (not the bonus)
        sequence = prompt + before + committed[:-1]
        assert length == len(sequence) and len(path) == len(committed)
        fresh = target.new_cache(length)
        target(torch.tensor([sequence]), cache=fresh, logits="none")
        torch.testing.assert_close(keys, fresh.keys[..., :length, :], atol=1e-5, rtol=0)
        torch.testing.assert_close(values, fresh.values[..., :length, :], atol=1e-5, rtol=0)
        assert positions[0].tolist() == list(range(length))


@pytest.mark.parametrize("pair", ["spread", "golden-oracle"])
def test_drafter_gets_the_features_of_the_committed_positions(pair: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every round the drafter gets exactly the features of positions [its cache length, start), and they equal the
    features a fresh target forward over the committed sequence gives there (so compaction took the right rows);
    the prompt's went into its cache while the prompt was prefilled (the first round reads none)."""
    target, drafter = spread_pair() if pair == "spread" else golden_pair()
    if pair == "spread":
        prompt, max_new, budget, sampling = [1, 2, 3, 4, 5, 6], 50, FULL_TREE, SamplingParams(temperature=1.0, seed=3)
    else:
        prompt, max_new, budget, sampling = GOLDEN_PROMPTS[1], 64, 16, SamplingParams()
        install_oracle(monkeypatch, drafter, prompt + run(target, None, prompt, max_new + 16)[0])
    seen: list[tuple[int, torch.Tensor, int]] = []
    def spy(original: Any, tgt: Any, pending: int, start: int, new_features: torch.Tensor, cache: Any,
            **kw: Any) -> torch.Tensor:
        seen.append((cache.length, new_features.clone(), start))
        return original(tgt, pending, start, new_features, cache, **kw)

    patch_draft_logits(monkeypatch, drafter, spy)
    tokens, stats = run_ddtree(target, drafter, prompt, max_new, budget=budget, sampling=sampling)
    monkeypatch.undo()
    assert seen[0][0] == len(prompt) == seen[0][2] and seen[0][1].shape[1] == 0
    assert stats.accepted_tokens > max_new // 2
    sequence = torch.tensor([prompt + tokens])
    reference = target(sequence, capture=drafter.config.target_layer_ids, logits="none").features
    assert reference is not None
    for drafter_len, new_features, start in seen:
        assert drafter_len + new_features.shape[1] == start
        torch.testing.assert_close(new_features, reference[:, drafter_len:start], atol=1e-4, rtol=1e-4)


def test_prompt_features_absorbed_chunk_by_chunk_equal_one_absorption() -> None:
    """A prompt prefilled in chunks of 3 with each chunk's features handed to the drafter's cache as it completes
    leaves that cache as absorbing the whole prompt's features at once does (and no features are returned)."""
    from dflash.generation.forwards import EAGER
    from dflash.generation.prefill import chunked_prefill

    target, drafter = spread_pair()
    prompt = torch.tensor([[5, 9, 2, 7, 7, 1, 3, 8, 4, 6]]) % target.config.vocab_size
    streamed = drafter.new_cache(16)
    with torch.inference_mode():
        logits, features = chunked_prefill(
            target, target.new_cache(16), prompt, chunk=3, capture=drafter.config.target_layer_ids,
            on_features=lambda chunk, start: EAGER.absorb_draft_context(drafter, chunk, start, streamed),
        )
        whole = target(prompt, capture=drafter.config.target_layer_ids, logits="none").features
        assert logits is not None and features is None and whole is not None
        at_once = drafter.new_cache(16)
        drafter.absorb_context(whole, torch.arange(10)[None], at_once)
    assert streamed.length == at_once.length == 10
    torch.testing.assert_close(streamed.keys[..., :10, :], at_once.keys[..., :10, :], atol=1e-5, rtol=0)
    torch.testing.assert_close(streamed.values[..., :10, :], at_once.values[..., :10, :], atol=1e-5, rtol=0)
    assert streamed.positions[0, :10].tolist() == list(range(10))


# ---- sampling ------------------------------------------------------------------------------------------------

SAMPLE_PROMPT = [1, 2, 3]
SAMPLE_NEW = 4  # the first round's tree may reach depth 2, so three tokens come from one tree verification


def _distribution(sampler: Any, samples: int) -> list[Counter[int]]:
    per_position: list[Counter[int]] = [Counter() for _ in range(SAMPLE_NEW)]
    for seed in range(samples):
        tokens = sampler(SamplingParams(temperature=1.0, seed=seed))
        for i, token in enumerate(tokens):
            per_position[i][token] += 1
    return per_position



@pytest.mark.slow
def test_sampling_keeps_the_target_distribution(monkeypatch: pytest.MonkeyPatch) -> None:
    """Per-position next-token distributions of DDTree and plain sampling agree within TV 0.06 (n=1500 each), for a
    partial tree (budget 6) and the full depth-2 tree (every path accepted: tokens 1-3 all come from one verified
    tree). The target is the spread pair (sampling really varies). Token 0 (prefill) and token 1 (the root's row,
    the first draw of the round) are the same draws as in plain decoding; tokens 2-3 are fresh samples from tree
    rows, so only they measure anything (observed TV about 0.02-0.03).

    A control run with a broken walk (the root's first child always accepted) must exceed the tolerance, proving
    the test can fail."""
    target, drafter = spread_pair()
    samples, tolerance = 1500, 0.06

    def plain(params: SamplingParams) -> list[int]:
        return run(target, None, SAMPLE_PROMPT, SAMPLE_NEW, sampling=params)[0]

    def tree(budget: int) -> Any:
        def sampler(params: SamplingParams) -> list[int]:
            return run_ddtree(target, drafter, SAMPLE_PROMPT, SAMPLE_NEW, budget=budget, sampling=params)[0]

        return sampler

    reference = _distribution(plain, samples)
    for budget in (6, VOCAB + VOCAB**2):
        spec = _distribution(tree(budget), samples)
        distances = [total_variation(p, s) for p, s in zip(reference, spec, strict=True)]
        assert max(distances) < tolerance, (budget, distances)

    original = ddtree.follow_tree

    def broken(tree_: DraftTree, posterior: Any) -> tuple[list[int], int]:
        if tree_.num_nodes == 0:
            return original(tree_, posterior)
        return [0, 1], int(posterior[1])  # accept the drafter's best first token whatever the target chose

    monkeypatch.setattr(ddtree, "follow_tree", broken)
    control = _distribution(tree(6), samples)
    control_distances = [total_variation(p, s) for p, s in zip(reference, control, strict=True)]
    assert max(control_distances) > tolerance, control_distances


def test_same_seed_same_output_when_sampling() -> None:
    target, drafter = golden_pair()
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=1234)
    prompt = random_prompts(1, 1000, seed=3, lengths=(40,))[0]
    first, _ = run_ddtree(target, drafter, prompt, 40, budget=16, sampling=params)
    second, _ = run_ddtree(target, drafter, prompt, 40, budget=16, sampling=params)
    other, _ = run_ddtree(
        target, drafter, prompt, 40, budget=16, sampling=SamplingParams(temperature=0.8, top_p=0.9, seed=99)
    )
    assert first == second
    assert first != other
