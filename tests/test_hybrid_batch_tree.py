"""DDTree in the batched core on a hybrid (Gated DeltaNet) target: a request's tree rows, packed with other
requests' rows, go through the linear-attention layers each from its parent's state and convolved over its own
path, and the accepted path is replayed into the request's state (`SlotTable.compact` -> `RecurrentStates.keep`).

Greedy DDTree in a batch therefore gives the plain greedy tokens (which are also the single-request DDTree
tokens): alone, mixed with plain and linear requests of other lengths, with a mostly right drafter whose accepted
paths end at many depths and run through non-first children, through a cancellation and through prefix-cache hits.
Sampled DDTree requests in a batch keep the target's distribution.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch

from dflash.batch import core as core_module
from dflash.batch.core import BatchCore
from dflash.batch.draft_pass import DraftRows
from dflash.batch.pool import SlotTable
from dflash.batch.target_pass import TargetRows, run_target
from dflash.drafter.model import DFlashDrafter, DrafterConfig
from dflash.drafter.vocab import DraftScores
from dflash.kv.prefix_cache import PrefixCache
from dflash.kv.recurrent import RecurrentStates
from dflash.models.gated_deltanet import new_recurrent_states
from dflash.models.model import CausalLM
from tests.batch_helpers import drain, make_core, make_sequence, sampled_counts
from tests.family_checks import check_batched_core_equals_plain
from tests.hybrid_models import hf_tiny_hybrid, ours_from_hf_hybrid
from tests.spec_helpers import one_torch_thread, random_prompts, run, total_variation
from tests.test_batch_core import _install_oracle as install_batch_oracle
from tests.test_ddtree_decode import install_oracle, run_ddtree
from tests.test_hybrid_spec import BLOCK, VOCAB, _drafter, _path, _tree_inputs

_threads = one_torch_thread

BUDGET = 8  # tree nodes per round: deeper than the drafter's BLOCK - 1 = 5 positions, so trees branch
CHUNK = 16


@pytest.fixture(scope="module")
def target() -> CausalLM:
    return ours_from_hf_hybrid(hf_tiny_hybrid(seed=11))


def _table(target: CausalLM, pool: Any, prompt: list[int]) -> SlotTable:
    """A request's table with `prompt` prefilled through a packed pass of its own."""
    table = SlotTable(pool)
    table.reserve(128)
    table.recurrent = new_recurrent_states(target.config, target.embed_tokens.weight)
    tokens = torch.tensor(prompt)
    run_target(target, pool, [TargetRows(table, tokens, torch.arange(len(prompt)))], ())
    table.crop(len(prompt))
    return table


def _single(target: CausalLM, prompt: list[int], tokens: torch.Tensor) -> torch.Tensor:
    """Logits [rows, vocab] of a single-request linear pass over `tokens` after `prompt`."""
    cache = target.new_cache(128)
    target(torch.tensor([prompt]), cache=cache)
    logits = target(tokens[None], cache=cache).logits
    assert logits is not None
    return logits[0]


@torch.no_grad()
def test_packed_tree_rows_equal_linear_passes_along_their_paths(target: CausalLM) -> None:
    """One packed pass: a tree of one request (branching, paths longer than the convolution's window) beside a
    linear block of another. Every tree row's logits are those of a single-request linear pass along its path, the
    block's those of its own pass; after keeping a path that is not the first rows (`compact`) and cropping the
    block, the next step of each request agrees with the single-request cache."""
    pool = make_core(target, None, max_batch=2).target_pool
    prompts = random_prompts(2, VOCAB, seed=21, lengths=(19, 30))
    tree_table, block_table = (_table(target, pool, prompt) for prompt in prompts)
    parents = [-1, 0, 0, 1, 2, 2, 5, 3]
    tokens, positions, mask = _tree_inputs(parents, len(prompts[0]), seed=3)
    tokens, positions = tokens[0], positions[0]  # [rows]
    block = torch.tensor([5, 9, 11])
    items = [
        TargetRows(tree_table, tokens, positions, mask, logit_rows=slice(0, len(parents))),
        TargetRows(block_table, block, len(prompts[1]) + torch.arange(3), logit_rows=slice(0, 3)),
    ]
    out = run_target(target, pool, items, ())
    for node in range(len(parents)):
        path = _path(parents, node)
        linear = _single(target, prompts[0], tokens[path])[-1]
        torch.testing.assert_close(out.logits[0][node], linear, rtol=1e-5, atol=1e-5, msg=f"row {node}")
    torch.testing.assert_close(out.logits[1], _single(target, prompts[1], block), rtol=1e-5, atol=1e-5)
    assert tree_table.recurrent is not None and tree_table.recurrent.tree_ancestors is None  # set for the pass only

    kept = _path(parents, 6)  # [0, 2, 5, 6]
    tree_table.compact(len(prompts[0]), torch.tensor(kept) + len(prompts[0]))
    block_table.crop(len(prompts[1]) + 2)
    following = torch.tensor([7])
    after = run_target(target, pool, [
        TargetRows(tree_table, following, torch.tensor([tree_table.length]), logit_rows=slice(0, 1)),
        TargetRows(block_table, following, torch.tensor([block_table.length]), logit_rows=slice(0, 1)),
    ], ())
    expected_tree = _single(target, prompts[0], torch.cat((tokens[kept], following)))[-1]
    expected_block = _single(target, prompts[1], torch.cat((block[:2], following)))[-1]
    torch.testing.assert_close(after.logits[0][0], expected_tree, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(after.logits[1][0], expected_block, rtol=1e-5, atol=1e-5)


def _record_kept_paths(monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    """Every path (row offsets in its tree) a recurrent state keeps through `compact`, in order."""
    kept: list[list[int]] = []
    original = RecurrentStates.keep

    def keep(self: RecurrentStates, start: int, positions: list[int]) -> None:
        kept.append([position - start for position in positions])
        original(self, start, positions)

    monkeypatch.setattr(RecurrentStates, "keep", keep)
    return kept


def _install_stepped_oracle(monkeypatch: pytest.MonkeyPatch, truth: list[int]) -> None:
    """Make the batched drafter right up to a depth that changes every round: in round r the right token is on top
    at depths 1 .. r % BLOCK and last below them (no tree path goes on); in every other cycle of BLOCK rounds a
    wrong token is put above the right one at depth 1 (the accepted path starts with a non-first child) where the
    budget still reaches the last right depth along that branch. So accepted paths end at every depth, first
    rows of their tree in one cycle, other rows in the next."""
    real = core_module.run_drafter
    rounds = [0]

    def oracle(drafter: Any, target: Any, pool: Any, items: list[DraftRows], graphs: Any = None) -> list[DraftScores]:
        scores = real(drafter, target, pool, items, graphs)
        patched = []
        for item, score in zip(items, scores, strict=True):
            logits = score.full().clone()  # [outputs, vocab]
            vocab = logits.shape[1]
            right_until = rounds[0] % BLOCK
            for row in range(logits.shape[0]):
                position = item.start + 1 + row
                if position >= len(truth):
                    break
                right, top, bottom = truth[position], float(logits[row].max()), float(logits[row].min())
                if row >= right_until:
                    logits[row, right] = bottom - 1.0
                elif row == 0 and (rounds[0] // BLOCK) % 2 and right_until < BLOCK - 1:
                    logits[row, (right + 1) % vocab] = top + 6.0
                    logits[row, right] = top + 5.5
                else:
                    logits[row, right] = top + 6.0
            patched.append(DraftScores(logits, None, vocab))
        rounds[0] += 1
        return patched

    monkeypatch.setattr(core_module, "run_drafter", oracle)


def test_a_lone_ddtree_request_rolls_back_at_every_depth(target: CausalLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """A DDTree request decoding alone in the batched core, with a drafter right to a depth that changes every
    round: the plain greedy tokens (which the single-request DDTree loop gives too); every accepted count from 0 to
    the whole block occurs, and paths through non-first children are kept (`compact` replays them)."""
    drafter = _drafter()
    prompt = random_prompts(1, VOCAB, seed=31, lengths=(27,))[0]
    plain, _ = run(target, None, prompt, 40, prefill_chunk=CHUNK)
    truth = prompt + run(target, None, prompt, 40 + BLOCK, prefill_chunk=CHUNK)[0]
    with monkeypatch.context() as mp:
        install_oracle(mp, drafter, truth)
        single, _ = run_ddtree(target, drafter, prompt, 40, budget=BUDGET, prefill_chunk=CHUNK)
    assert single == plain
    kept = _record_kept_paths(monkeypatch)
    _install_stepped_oracle(monkeypatch, truth)
    core = make_core(target, drafter, max_batch=4, prefill_chunk=CHUNK, ddtree_budget=BUDGET)
    seq = make_sequence(target, prompt, 40, "ddtree")
    core.add(seq)
    drain(core)
    assert seq.error is None and seq.sink.token_ids == plain
    assert set(seq.stats.accepted_per_round) == set(range(BLOCK)), seq.stats.accepted_per_round
    assert len({len(path) for path in kept}) >= 3, kept  # compacted paths of several depths
    assert all(path != list(range(len(path))) for path in kept)  # compact is used only off the first rows


def test_ddtree_requests_mixed_with_plain_and_linear_ones(target: CausalLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """Six requests of three prompt lengths (plain, linear and DDTree in turn, prefill chunks beside trees) decoding
    together with a mostly right drafter: each gives its plain greedy tokens, and trees keep non-first paths."""
    kept = _record_kept_paths(monkeypatch)
    core = check_batched_core_equals_plain(monkeypatch, target, _drafter(), CHUNK)
    assert kept and core.target_pool.free_blocks == core.target_pool.num_blocks


def test_cancelling_a_ddtree_request_mid_batch(target: CausalLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """A DDTree request cancelled while decoding (its tree rows were in the previous packed passes) ends with a
    prefix of its plain tokens and gives its memory back; the others, a DDTree one among them, go on to their
    plain tokens (a mostly right drafter: their trees keep paths through non-first children)."""
    prompts = random_prompts(3, VOCAB, seed=32, lengths=(20, 45, 12))
    plain = [run(target, None, p, 30, prefill_chunk=CHUNK)[0] for p in prompts]
    truths = [p + run(target, None, p, 30 + BLOCK, prefill_chunk=CHUNK)[0] for p in prompts]
    kept = _record_kept_paths(monkeypatch)
    stop = [False]
    core = make_core(target, _drafter(), max_batch=3, prefill_chunk=CHUNK, ddtree_budget=BUDGET)
    monkeypatch.setattr(core.policy, "plan", lambda *args, **kwargs: True)  # speculate every step
    seqs = [
        make_sequence(target, prompts[0], 30, "ddtree", should_stop=lambda: stop[0]),
        make_sequence(target, prompts[1], 30, "ddtree"),
        make_sequence(target, prompts[2], 30, "linear"),
    ]
    for seq in seqs:
        core.add(seq)
    core.step()  # admits every request (their drafter tables exist from here on)
    install_batch_oracle(monkeypatch, {id(seq.drafter): truth for seq, truth in zip(seqs, truths, strict=True)})
    for _ in range(4):
        core.step()
    assert seqs[0].phase == "decode" and seqs[0].stats.rounds > 0
    stop[0] = True
    core.step()
    assert seqs[0].done.is_set() and seqs[0].sink.finish_reason == "cancelled"
    produced = seqs[0].sink.token_ids
    assert 0 < len(produced) < 30 and produced == plain[0][: len(produced)]
    drain(core)
    for seq, expected in zip(seqs[1:], plain[1:], strict=True):
        assert seq.error is None and seq.sink.token_ids == expected
    assert kept and seqs[1].stats.acceptance_length > 2.0
    assert core.target_pool.free_blocks == core.target_pool.num_blocks
    assert core.drafter_pool is not None and core.drafter_pool.free_blocks == core.drafter_pool.num_blocks


def test_prefix_cache_hits_restore_the_state_before_ddtree_rounds(
    target: CausalLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DDTree requests whose prompts share cached blocks resume from the block's recurrent state and decode the
    plain tokens; the tree rounds after the hit roll back to paths from that restored state."""
    drafter = _drafter()
    shared = random_prompts(1, VOCAB, seed=33, lengths=(32,))[0]
    tails = random_prompts(3, VOCAB, seed=34, lengths=(5, 21, 12))
    prompts = [shared + tail for tail in tails]
    plain = [run(target, None, p, 24, prefill_chunk=CHUNK)[0] for p in prompts]
    truths = [p + run(target, None, p, 24 + BLOCK, prefill_chunk=CHUNK)[0] for p in prompts]
    prefix_cache = PrefixCache(2**24, block_tokens=CHUNK, feature_layers=drafter.config.target_layer_ids)
    core = make_core(target, drafter, max_batch=3, prefill_chunk=CHUNK, ddtree_budget=BUDGET,
                     prefix_cache=prefix_cache)
    monkeypatch.setattr(core.policy, "plan", lambda *args, **kwargs: True)
    first = make_sequence(target, prompts[0], 24, "ddtree")
    core.add(first)
    drain(core)
    kept = _record_kept_paths(monkeypatch)
    later = [make_sequence(target, p, 24, mode) for p, mode in zip(prompts[1:], ("ddtree", "none"), strict=True)]
    for seq in later:
        core.add(seq)
    core.step()  # admits both (and restores their cached prefix)
    install_batch_oracle(monkeypatch, {id(seq.drafter): truth for seq, truth in zip(later, truths[1:], strict=True)})
    drain(core)
    assert [seq.sink.token_ids for seq in (first, *later)] == plain
    assert first.stats.cached_tokens == 0 and [seq.stats.cached_tokens for seq in later] == [32, 32]
    assert later[0].stats.acceptance_length > 2.0 and kept


# ---- sampling ------------------------------------------------------------------------------------------------

SAMPLED_VOCAB, SAMPLED_BLOCK, SAMPLED_NEW = 8, 4, 4


def _sampling_pair() -> tuple[CausalLM, DFlashDrafter]:
    """An 8-token hybrid target (its head scaled up: next-token distributions far from uniform) and a random
    one-layer drafter with blocks of 4: trees of depth up to 3 whose paths often end inside the tree."""
    hf = hf_tiny_hybrid(seed=3, vocab_size=SAMPLED_VOCAB)
    with torch.no_grad():
        hf.lm_head.weight.mul_(3.0)
    raw = {
        "num_hidden_layers": 1, "num_target_layers": 4, "hidden_size": 64, "intermediate_size": 64,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": SAMPLED_VOCAB,
        "block_size": SAMPLED_BLOCK,
        "dflash_config": {"mask_token_id": SAMPLED_VOCAB - 1, "target_layer_ids": [1]},
    }
    torch.manual_seed(7)
    drafter = DFlashDrafter(DrafterConfig.from_dict(raw)).eval().requires_grad_(False)
    return ours_from_hf_hybrid(hf), drafter


def _sampled_counts(
    pair: tuple[CausalLM, DFlashDrafter], mode: str, samples: int, monkeypatch: pytest.MonkeyPatch
) -> list[Counter[int]]:
    """Token counts per output position of `samples` sampled requests, 64 per batch, every step speculating."""

    def speculate(core: BatchCore) -> None:
        monkeypatch.setattr(core.policy, "plan", lambda *args, **kwargs: True)

    return sampled_counts(*pair, mode, samples, SAMPLED_NEW, budget=6, block=SAMPLED_BLOCK, prepare=speculate)


@pytest.mark.slow
def test_sampled_ddtree_in_a_batch_keeps_the_hybrid_target_s_distribution(monkeypatch: pytest.MonkeyPatch) -> None:
    """Per-position token distributions of 3000 sampled DDTree requests (64 per batch, trees over each request's
    recurrent state) agree with plain sampling's within TV 0.06; a control whose tree walk takes the first child
    whatever the target sampled exceeds it (the test can fail)."""
    pair = _sampling_pair()
    samples, tolerance = 3000, 0.06
    reference = _sampled_counts(pair, "none", samples, monkeypatch)
    sampled = _sampled_counts(pair, "ddtree", samples, monkeypatch)
    distances = [total_variation(p, s) for p, s in zip(reference, sampled, strict=True)]
    assert max(distances) < tolerance, distances
    original = core_module.follow_tree

    def broken(tree: Any, posterior: Any) -> tuple[list[int], int]:
        if tree.num_nodes == 0:
            return original(tree, posterior)
        return [0, 1], int(posterior[1])

    monkeypatch.setattr(core_module, "follow_tree", broken)
    control = _sampled_counts(pair, "ddtree", samples, monkeypatch)
    assert max(total_variation(p, s) for p, s in zip(reference, control, strict=True)) > tolerance
