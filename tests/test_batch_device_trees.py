"""Greedy DDTree steps built on the device (`dflash.batch.device_trees`) commit what the host-built steps commit: run
eagerly on the CPU (the CUDA graphs' passes and tree programs' torch forms) and, marked, as graphs on a GPU."""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import pytest
import torch

import dflash.batch.core as core_module
from dflash.batch.core import BatchCore
from dflash.batch.draft_pass import DraftRows, absorb_context_rows, run_drafter
from dflash.batch.padded import PaddedBatch
from dflash.batch.sequence import Sequence
from dflash.drafter.vocab import DraftScores
from dflash.environment import DEVICE_TREES
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

PROMPT_LENGTHS = (7, 90, 40, 3, 25)  # 90 and 40: more context rows than a block when their first round comes
MAX_NEW = (64, 50, 20, 72, 40)  # requests end at different steps: the others move to lower indices


def _references(target: Any, prompts: list[list[int]]) -> list[list[int]]:
    return [prompt + run(target, None, prompt, new)[0] for prompt, new in zip(prompts, MAX_NEW, strict=True)]


Drafts = dict[tuple[int, int], torch.Tensor]  # (request, start) -> the drafter's own logits [drafted rows, vocab]


def _install_oracles(monkeypatch: pytest.MonkeyPatch, core: BatchCore, seqs: list[Sequence],
                     references: list[list[int]], drafts: Drafts) -> None:
    """Make the drafter mostly right on both paths (`oracle_logits`): the host-built rounds' `run_drafter` and the
    device rounds' drafter pass, each request found by its drafter table; the drafter's own logits are kept in
    `drafts`."""
    def request_of_table(first_block: int) -> int:
        for index, seq in enumerate(seqs):
            if seq.drafter is not None and seq.drafter.blocks and seq.drafter.blocks[0] == first_block:
                return index
        raise AssertionError("no request owns that drafter table")

    def host_oracle(drafter: Any, target: Any, pool: Any, items: list[DraftRows], graphs: Any = None) -> list[DraftScores]:
        scores = run_drafter(drafter, target, pool, items, graphs)
        patched = []
        for item, score in zip(items, scores, strict=True):
            request = request_of_table(item.table.blocks[0])
            drafts[(request, item.start)] = score.full().cpu()
            logits = oracle_logits(score.full(), item.start, references[request])
            patched.append(DraftScores(logits, None, logits.shape[1]))
        return patched

    monkeypatch.setattr(core_module, "run_drafter", host_oracle)
    if core.device_trees is None:
        return
    trees = core.device_trees
    device_pass = trees.draft_pass
    # the device rounds' oracle runs inside their graph: no host reads, each request's reference found through its
    # drafter table's first block (filled in before each round)
    assert core.drafter_pool is not None
    device = core.drafter_pool.device
    longest = max(len(reference) for reference in references)
    by_block = torch.zeros((core.drafter_pool.num_blocks, longest), dtype=torch.long, device=device)
    lengths = torch.zeros(core.drafter_pool.num_blocks, dtype=torch.long, device=device)
    real_launch = trees.launch
    # id(drafter batch) -> its last pass's (own logits [requests, block - 1, vocab], starts [requests], drafter
    # tables' first blocks [requests], row counts [requests]), kept on the device (inside a graph: its buffers)
    own: dict[int, tuple[torch.Tensor, ...]] = {}

    def launch_with_references(step: list[Sequence], budget: int, **options: Any) -> Any:
        for seq in step:
            if seq.phase == "done":  # an ended request's slot rides as padding
                continue
            assert seq.drafter is not None
            reference = references[seqs.index(seq)]
            by_block[seq.drafter.blocks[0], : len(reference)] = torch.tensor(reference, device=device)
            lengths[seq.drafter.blocks[0]] = len(reference)
        previous = real_launch(step, budget, **options)
        assert trees.launched is not None
        logits, starts, firsts, counts = (t.cpu() for t in own[id(trees._entries[trees.launched.shape].drafter_batch)])
        for index in range(len(step)):
            assert bool(int(counts[index])) == (step[index].phase != "done")
            if step[index].phase == "done":
                continue
            request = next(i for i, seq in enumerate(seqs) if seq.drafter is not None and seq.drafter.blocks
                           and seq.drafter.blocks[0] == int(firsts[index]))
            drafts[(request, int(starts[index]))] = logits[index, : trees.depth(budget)]
        return previous

    def device_oracle(batch: PaddedBatch, context_rows: torch.Tensor) -> torch.Tensor:
        logits = device_pass(batch, context_rows)  # [requests, block - 1, vocab]
        first = batch.blocks[:, 0]  # [requests]
        start = batch.past[:, None]  # [requests, 1]
        position = start + 1 + torch.arange(logits.shape[1], device=device)[None]  # [requests, rows]
        inside = position < lengths[first][:, None]
        right = by_block[first].gather(1, position.clamp(max=longest - 1))  # [requests, rows]
        wrong = (right + 1) % logits.shape[-1]
        swapped = ((position * 31 + start * 17) % 7 == 0) | ((position * 31 + start * 17) % 7 == 3)
        top = logits.max(dim=-1).values  # [requests, rows]
        own[id(batch)] = (logits, batch.past.clone(), first.clone(), batch.counts.clone())
        logits = logits.clone()
        old_right = logits.gather(2, right[..., None])[..., 0]
        logits.scatter_(2, right[..., None], torch.where(inside, torch.where(swapped, top + 5.5, top + 6.0),
                                                          old_right)[..., None])
        old_wrong = logits.gather(2, wrong[..., None])[..., 0]
        logits.scatter_(2, wrong[..., None], torch.where(inside & swapped, top + 6.0, old_wrong)[..., None])
        return logits

    trees.launch = launch_with_references  # type: ignore[method-assign]
    trees.draft_pass = device_oracle


def _serve(
    monkeypatch: pytest.MonkeyPatch, device_trees: bool, device: torch.device, mode: str = "ddtree"
) -> tuple[list[Sequence], tuple[int, int, int, int], Drafts]:
    """Five greedy DDTree (or linear: chains on the device) requests, at most four decoding together (an ended
    request's slot riding as padding while the others fill the request bucket, the fifth joining the chain of
    rounds), through the padded passes (graphs on CUDA) -> (the sequences, (the device rounds launched, those
    launched after an unread one, those with an ended request's slot, those a request joined), the drafter's logits
    of every round)."""
    monkeypatch.setenv(DEVICE_TREES, "1" if device_trees else "0")
    target, drafter = golden_pair(str(device))
    prompts = random_prompts(5, target.config.vocab_size, seed=21, lengths=PROMPT_LENGTHS)
    references = _references(target, prompts)
    cuda = device.type == "cuda"
    core = make_core(target, drafter, max_batch=4, prefill_chunk=32, ddtree_budget=6, cuda_graphs=cuda,
                     eager_padded=not cuda)
    core.policy.plan = lambda *args, **kwargs: True  # its timing of real steps must not change the rounds
    core.tree_budgets.forced = core.chain_lengths.forced = True
    assert (core.device_trees is not None) == device_trees
    seqs = [make_sequence(target, p, new, mode) for p, new in zip(prompts, MAX_NEW, strict=True)]
    drafts: Drafts = {}
    _install_oracles(monkeypatch, core, seqs, references, drafts)
    # rounds launched, launched after an unread one, with an ended request's slot, with a request joining
    rounds = followed = holes = joins = 0
    if core.device_trees is not None:
        trees = core.device_trees
        counted_launch = trees.launch

        def counted(step: list[Sequence], budget: int, *, follow: bool = False, ended: Any = None, **options: Any) -> Any:
            nonlocal rounds, followed, holes, joins
            rounds += 1
            followed += follow
            holes += bool(ended)
            joins += bool(options.get("joined"))
            return counted_launch(step, budget, follow=follow, ended=ended, **options)

        trees.launch = counted  # type: ignore[method-assign]
    for seq in seqs:
        core.add(seq)
    drain(core)
    for seq, prompt, reference in zip(seqs, prompts, references, strict=True):
        assert seq.error is None
        assert seq.sink.token_ids == reference[len(prompt):]
    assert core.target_pool.free_blocks == core.target_pool.num_blocks
    assert core.drafter_pool is not None and core.drafter_pool.free_blocks == core.drafter_pool.num_blocks
    return seqs, (rounds, followed, holes, joins), drafts


def _commit_like_the_host(
    monkeypatch: pytest.MonkeyPatch, device: torch.device, tolerance: float, mode: str = "ddtree"
) -> None:
    on, (rounds, followed, holes, joins), device_drafts = _serve(monkeypatch, True, device, mode)
    off, _, host_drafts = _serve(monkeypatch, False, device, mode)
    assert rounds >= 15 and followed >= 5 and (holes >= 1 or mode == "linear")  # ended slots: the trees' runs
    assert joins >= 1  # the fifth request joins the running chain in an ended request's slot
    for device_seq, host_seq, new in zip(on, off, MAX_NEW, strict=True):
        # a chain stops at the oracle's first swapped position, a tree goes on through the second-best child
        assert device_seq.stats.acceptance_length > (2.5 if mode == "ddtree" else 1.8)
        # round for round, but for the last rounds, where a host-built tree is cut to the tokens left and a device
        # round still drafts its full depth (the sink keeps what was asked for; linear rounds are never cut)
        uncut = _uncut_rounds(host_seq.stats.accepted_per_round, new, DEPTH if mode == "ddtree" else 0)
        assert uncut >= len(host_seq.stats.accepted_per_round) - 3
        assert device_seq.stats.accepted_per_round[:uncut] == host_seq.stats.accepted_per_round[:uncut]
    # the drafter read the same context in every round both made (the device rounds' absorbed rows, kept features)
    common = device_drafts.keys() & host_drafts.keys()
    assert len(common) >= len(host_drafts) - 3 * len(MAX_NEW)
    for key in common:
        expected = host_drafts[key]
        torch.testing.assert_close(device_drafts[key][: expected.shape[0]], expected, atol=tolerance, rtol=tolerance)


DEPTH = 6  # the trees' drafted depth (budget 6)


def _uncut_rounds(accepted_per_round: list[int], max_new: int, depth: int) -> int:
    """The leading rounds whose host-built tree had its full depth: at least depth + 1 tokens left to produce (the
    prefill produced the first)."""
    produced, rounds = 1, 0
    for accepted in accepted_per_round:
        if max_new - produced - 1 < depth:
            break
        produced += accepted + 1
        rounds += 1
    return rounds


def test_device_trees_commit_round_for_round_what_host_built_trees_commit(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a mostly right drafter (trees continue through non-first children, so paths are compacted), five
    requests joining and ending at different steps (each one's drafter context handed between request slots, the
    long prompts' context absorbed before their first device round): every request gives its greedy tokens alone and
    accepts, round for round, what the host-built trees accept; every pool block comes back."""
    _commit_like_the_host(monkeypatch, torch.device("cpu"), 1e-4)


def test_device_chains_commit_round_for_round_what_host_built_linear_rounds_commit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Greedy linear requests on the device trees take chains of the drafter's argmax tokens: the same five requests
    give their greedy tokens alone and accept, round for round, what host-built linear rounds accept."""
    _commit_like_the_host(monkeypatch, torch.device("cpu"), 1e-4, mode="linear")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("mode", ["ddtree", "linear"])
def test_graphed_device_trees_commit_what_host_built_trees_commit(monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    """The same through the captured graphs and the Triton tree programs on a GPU."""
    _commit_like_the_host(monkeypatch, torch.device("cuda"), 1e-3, mode)


def test_requests_that_stop_or_are_cancelled_while_a_device_round_is_in_flight(monkeypatch: pytest.MonkeyPatch) -> None:
    """Device rounds launched one ahead, mostly right drafts: a request that reaches its EOS ends there (its round may
    have committed tokens past it), one cancelled mid-generation ends with a prefix of its tokens, the third runs to
    its limit; the rounds still in flight for the ended ones change nothing, and every pool block comes back."""
    target, drafter = golden_pair()
    prompts = random_prompts(3, target.config.vocab_size, seed=8, lengths=(12, 33, 20))
    references = [prompt + run(target, None, prompt, 80)[0] for prompt in prompts]
    outputs = [reference[len(prompt):] for prompt, reference in zip(prompts, references, strict=True)]
    eos = outputs[0][40]  # request 0 stops at the first occurrence of this token
    expected = outputs[0][: outputs[0].index(eos) + 1]
    assert 8 < len(expected) < len(outputs[0])
    core = make_core(target, drafter, max_batch=3, ddtree_budget=6, eager_padded=True)
    core.policy.plan = lambda *args, **kwargs: True
    core.tree_budgets.forced = True
    holder: list[Sequence] = []
    seqs = [
        make_sequence(target, prompts[0], 80, "ddtree", eos=(eos,)),
        make_sequence(target, prompts[1], 80, "ddtree", should_stop=lambda: holder[0].produced >= 20),
        make_sequence(target, prompts[2], 80, "ddtree"),
    ]
    holder.append(seqs[1])
    _install_oracles(monkeypatch, core, seqs, references, {})
    assert core.device_trees is not None
    followed = 0
    real_launch = core.device_trees.launch

    def counted(step: list[Sequence], budget: int, *, follow: bool = False, ended: Any = None, **options: Any) -> Any:
        nonlocal followed
        followed += follow
        return real_launch(step, budget, follow=follow, ended=ended, **options)

    core.device_trees.launch = counted  # type: ignore[method-assign]
    for seq in seqs:
        core.add(seq)
    drain(core)
    assert followed >= 3
    assert seqs[0].error is None and seqs[0].sink.token_ids == expected
    assert seqs[1].sink.finish_reason == "cancelled" and len(seqs[1].sink.token_ids) >= 20
    assert seqs[1].sink.token_ids == outputs[1][: len(seqs[1].sink.token_ids)]
    assert seqs[2].error is None and seqs[2].sink.token_ids == outputs[2]
    assert core.target_pool.free_blocks == core.target_pool.num_blocks
    assert core.drafter_pool is not None and core.drafter_pool.free_blocks == core.drafter_pool.num_blocks


def test_device_rounds_after_prefix_cache_hits_give_each_request_its_tokens() -> None:
    """DDTree requests whose prompts share a cached 64-token prefix (keys, values and the drafter's features restored
    from the prefix cache) decode through device rounds: each gives its greedy tokens alone."""
    target, drafter = golden_pair()
    shared = random_prompts(1, target.config.vocab_size, seed=15, lengths=(64,))[0]
    tails = random_prompts(4, target.config.vocab_size, seed=16, lengths=(5, 40))
    cache = PrefixCache(64 * 2**20, block_tokens=32, feature_layers=drafter.config.target_layer_ids)
    core = make_core(target, drafter, max_batch=4, prefill_chunk=32, prefix_cache=cache, eager_padded=True)
    core.policy.plan = lambda *args, **kwargs: True
    core.tree_budgets.forced = True
    assert core.device_trees is not None
    launches = 0
    real_launch = core.device_trees.launch

    def counted(step: list[Sequence], budget: int, **options: Any) -> Any:
        nonlocal launches
        launches += 1
        return real_launch(step, budget, **options)

    core.device_trees.launch = counted  # type: ignore[method-assign]
    first = make_sequence(target, shared + tails[0], 40, "ddtree")
    core.add(first)
    drain(core)
    later = [make_sequence(target, shared + tail, 40, "ddtree") for tail in tails[1:]]
    for seq in later:
        core.add(seq)
    drain(core)
    assert launches > 10
    assert all(seq.stats.cached_tokens == 64 for seq in later)
    for seq in [first, *later]:
        assert seq.error is None
        assert seq.sink.token_ids == run(target, None, seq.request.prompt_ids, 40)[0]


def test_a_prompt_s_drafter_context_is_absorbed_as_its_prefill_ends() -> None:
    """When a speculative request's last prompt chunk is prefilled, its drafter context but the last block is already
    in the drafter pool (committed in its table), so its first device round only stores that block; the keys and
    values written equal absorbing the whole prompt's context at the first round, and the request decodes its
    greedy tokens."""
    target, drafter = golden_pair()
    block = drafter.config.block_size
    prompt = random_prompts(1, target.config.vocab_size, seed=21, lengths=(3 * block + 5,))[0]
    core = make_core(target, drafter, max_batch=2, prefill_chunk=64, eager_padded=True)
    seq = make_sequence(target, prompt, 12, "ddtree")
    core.add(seq)
    while seq.phase != "decode":
        core.step()
    assert seq.drafter is not None and seq.new_features is not None and core.drafter_pool is not None
    absorbed = len(prompt) - block
    assert seq.drafter.length == absorbed and seq.new_features.shape[0] == block
    slots = seq.drafter.slots(0, absorbed)
    early_keys = core.drafter_pool.keys[:, :, slots].clone()
    reference = make_core(target, drafter, max_batch=2, prefill_chunk=64, eager_padded=True)
    other = make_sequence(target, prompt, 12, "ddtree")
    reference.add(other)
    reference._absorb_prompt = lambda seq: None  # type: ignore[method-assign]  # the whole context at the first round
    while other.phase != "decode":
        reference.step()
    assert other.drafter is not None and other.drafter.length == 0 and other.new_features is not None
    assert reference.drafter_pool is not None
    # what a first round's load does with the whole context
    absorb_context_rows(drafter, reference.drafter_pool,
                        [DraftRows(other.drafter, other.new_features[:absorbed], 0, 0, 0)])
    torch.testing.assert_close(reference.drafter_pool.keys[:, :, other.drafter.slots(0, absorbed)], early_keys)
    drain(core)
    assert seq.error is None and seq.sink.token_ids == run(target, None, prompt, 12)[0]


def _alternating_run(split_absorbs: bool) -> tuple[list[list[int]], dict[tuple[int, int], torch.Tensor], int]:
    """Three greedy DDTree requests whose steps take turns: twenty plain steps, then three device rounds, and so on.
    `split_absorbs`: the context rows of the plain steps go into the drafter pool one request at a time (instead of
    in one packed pass) -> (each request's tokens, the drafter's logits of every device round by (request, start),
    the packed absorbs of more than one request)."""
    target, drafter = golden_pair()
    prompts = random_prompts(3, target.config.vocab_size, seed=31, lengths=(9, 30, 17))
    core = make_core(target, drafter, max_batch=4, ddtree_budget=6, eager_padded=True)
    core.policy.plan = lambda *args, **kwargs: True
    steps = 0

    def alternate(bucket: int, requests: int, budgets: list[int], expected: Any) -> int:
        nonlocal steps
        steps += 1
        return budgets[-1] if steps % 23 >= 20 else 0  # twenty plain steps: more rows than a block (16)

    core.tree_budgets.choose = alternate  # type: ignore[method-assign]
    assert core.device_trees is not None
    trees = core.device_trees
    seqs = [make_sequence(target, prompt, 72, "ddtree") for prompt in prompts]
    firsts: dict[int, int] = {}  # drafter table's first block -> request
    drafts: dict[tuple[int, int], torch.Tensor] = {}
    real_pass = trees.draft_pass

    def recorded(batch: PaddedBatch, context_rows: torch.Tensor) -> torch.Tensor:
        logits = real_pass(batch, context_rows)  # [requests, block - 1, vocab]
        for index in range(int((batch.counts > 0).sum())):
            request = firsts[int(batch.blocks[index, 0])]
            drafts[(request, int(batch.past[index]))] = logits[index].clone()
        return logits

    trees.draft_pass = recorded
    packed = 0
    assert core.drafter_graphs is not None
    stores = core.drafter_graphs.context
    real_absorb = stores.absorb

    def absorb(items: list[DraftRows]) -> None:
        nonlocal packed
        packed += len([item for item in items if item.new_features.shape[0]]) > 1
        if not split_absorbs:
            real_absorb(items)
            return
        for item in items:
            real_absorb([item])

    stores.absorb = absorb  # type: ignore[method-assign]
    for seq in seqs:
        core.add(seq)
    while any(seq.phase != "decode" for seq in seqs):
        core.step()
    for index, seq in enumerate(seqs):
        assert seq.drafter is not None
        firsts[seq.drafter.blocks[0]] = index
    drain(core)
    for seq, prompt in zip(seqs, prompts, strict=True):
        assert seq.error is None and seq.sink.token_ids == run(target, None, prompt, 72)[0]
    return [seq.sink.token_ids for seq in seqs], drafts, packed


def test_device_rounds_after_plain_steps_absorb_every_request_s_rows_in_one_pass() -> None:
    """Greedy DDTree requests taking turns between plain steps and device rounds give their greedy tokens alone, and
    the first round after plain steps writes every request's new drafter context (the plain steps' rows) in one
    packed pass: the drafter then drafts, round for round, what it drafts when each request's rows go in alone."""
    tokens, drafts, packed = _alternating_run(split_absorbs=False)
    alone_tokens, alone_drafts, _ = _alternating_run(split_absorbs=True)
    assert tokens == alone_tokens
    assert packed >= 2  # packed absorbs at the returns to trees
    assert drafts.keys() == alone_drafts.keys() and len(drafts) >= 12
    for key, logits in drafts.items():
        torch.testing.assert_close(logits, alone_drafts[key], atol=1e-4, rtol=1e-4)


def test_warm_up_sets_up_the_chains_of_an_engine_serving_linear_requests() -> None:
    """`capture_graphs(chains=True)` (the warm-up of an engine whose mode is linear) sets up device rounds of chains,
    at every request bucket, of the chain lengths its steps choose among, and no tree shape."""
    target, drafter = golden_pair()
    core = make_core(target, drafter, max_batch=4, linear_drafts=7, eager_padded=True)
    assert core.device_trees is not None
    core.capture_graphs(max_keys=256, chains=True)
    shapes = list(core.device_trees._entries)
    assert shapes and all(shape.chain for shape in shapes)
    assert {shape.requests for shape in shapes} == {1, 2, 4}
    assert {shape.budget for shape in shapes if shape.requests == 4} == {3, 7}


# ---- sampled requests on the device rounds --------------------------------------------------------------------

SAMPLED_VOCAB, SAMPLED_BLOCK, SAMPLED_NEW = 8, 4, 4


def _device_samples(samples: int, mode: str, launches: list[int]) -> list[Counter[int]]:
    """`samples` requests (seeds 0..) at temperature 1 through the CUDA path's steps run eagerly, DDTree's rounds
    and linear chains always on the device (`launches` gains each batch's device rounds)."""
    def prepare(core: BatchCore) -> None:
        core.tree_budgets.forced = core.chain_lengths.forced = True
        core.policy.plan = lambda *args, **kwargs: True  # type: ignore[method-assign]
        if core.device_trees is not None:
            trees = core.device_trees
            launch = trees.launch

            def counted(*args: Any, **kwargs: Any) -> Any:
                launches.append(1)
                return launch(*args, **kwargs)

            trees.launch = counted  # type: ignore[method-assign]

    pair = tiny_random_pair(SAMPLED_VOCAB, 2.0, SAMPLED_BLOCK)
    return sampled_counts(*pair, mode, samples, SAMPLED_NEW, budget=6, block=SAMPLED_BLOCK, prepare=prepare,
                          eager_padded=True)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ddtree", "linear"])
def test_sampled_requests_on_device_rounds_keep_the_target_distribution(
    monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """Per-position token distributions of 1500 DDTree (or linear: chains) requests sampled at temperature 1 (64 in
    a batch), every round on the device (each row sampled there, the walk following the sampled token), agree with
    plain decoding's within TV 0.06; a control whose rows take the argmax instead exceeds it (the test can fail)."""
    samples, tolerance = 1500, 0.06
    launches: list[int] = []
    reference = _device_samples(samples, "none", launches)
    assert not launches
    sampled = _device_samples(samples, mode, launches)
    assert len(launches) >= 100
    distances = [total_variation(p, s) for p, s in zip(reference, sampled, strict=True)]
    assert max(distances) < tolerance, distances
    import dflash.batch.device_trees as trees_module

    monkeypatch.setattr(trees_module, "choose_rows", lambda logits, sampling, uniforms, mode, greedy: greedy)
    control = _device_samples(samples, mode, launches)
    assert max(total_variation(p, s) for p, s in zip(reference, control, strict=True)) > tolerance


def _sampled_run(monkeypatch: pytest.MonkeyPatch, mode: str, device_trees: bool) -> tuple[list[list[int]], int, int]:
    """Three seeded sampled requests (temperature 0.9; one with top-p, one with top-k), two decoding at a time (the
    third joins when one ends), through the padded passes, with or without device rounds -> (each request's tokens,
    device rounds launched, rounds a request joined)."""
    monkeypatch.setenv(DEVICE_TREES, "1" if device_trees else "0")
    target, drafter = golden_pair()
    prompts = random_prompts(3, target.config.vocab_size, seed=47, lengths=(9, 30))
    sampling = [SamplingParams(temperature=0.9, seed=1), SamplingParams(temperature=0.9, top_p=0.9, seed=2),
                SamplingParams(temperature=0.9, top_k=40, seed=3)]
    # budget 32 (the CUDA default): admission reserves a whole round past the output, so rounds follow to the end
    core = make_core(target, drafter, max_batch=2, ddtree_budget=32, eager_padded=True)
    core.policy.plan = lambda *args, **kwargs: True
    core.tree_budgets.forced = core.chain_lengths.forced = True
    launches = joins = 0
    if core.device_trees is not None:
        launch = core.device_trees.launch

        def counted(*args: Any, **kwargs: Any) -> Any:
            nonlocal launches, joins
            launches += 1
            joins += bool(kwargs.get("joined"))
            return launch(*args, **kwargs)

        core.device_trees.launch = counted  # type: ignore[method-assign]
    new = (48, 24, 48)  # the second ends first: the third joins the running chain in its slot
    seqs = [make_sequence(target, p, n, mode, sampling=s) for p, n, s in zip(prompts, new, sampling, strict=True)]
    for seq in seqs:
        core.add(seq)
    drain(core)
    assert all(seq.error is None and len(seq.sink.token_ids) == n for seq, n in zip(seqs, new, strict=True))
    return [seq.sink.token_ids for seq in seqs], launches, joins


@pytest.mark.parametrize("mode", ["linear", "ddtree"])
def test_sampled_requests_draw_the_same_tokens_through_device_rounds_and_host_built_ones(
    monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """Seeded sampled linear (chains) and DDTree requests on the device rounds, one joining the running chain,
    commit token for token what host-built rounds commit (each row drawn with the uniform of its seed and position,
    whatever the rounds), and they did sample (not the greedy tokens)."""
    on, launched, joins = _sampled_run(monkeypatch, mode, True)
    off, none, _ = _sampled_run(monkeypatch, mode, False)
    assert launched >= 10 and joins >= 1 and none == 0
    assert on == off
    target, _ = golden_pair()
    prompt = random_prompts(3, target.config.vocab_size, seed=47, lengths=(9, 30))[0]
    assert on[0] != run(target, None, prompt, 40)[0]



def test_a_step_that_captured_a_graph_is_not_measured_as_its_option_s_cost(monkeypatch: pytest.MonkeyPatch) -> None:
    """A step that captures a graph (a shape's first use) takes far longer than its steady cost: the tree budget
    chooser does not count it. Here every fourth device round "captures" (the process's capture count moves and the
    launch stalls 0.3 s): no observed step takes that long, and the other steps are observed."""
    target, drafter = golden_pair()
    prompts = random_prompts(3, target.config.vocab_size, seed=37, lengths=(9, 30, 17))
    core = make_core(target, drafter, max_batch=4, eager_padded=True)
    core.policy.plan = lambda *args, **kwargs: True
    assert core.device_trees is not None
    captures = 0
    monkeypatch.setattr(core_module, "captures_made", lambda: captures)
    real_launch = core.device_trees.launch
    launches = 0

    def launch(step: list[Sequence], budget: int, **options: Any) -> Any:
        nonlocal launches, captures
        launches += 1
        if launches % 4 == 0:
            captures += 1
            time.sleep(0.3)
        return real_launch(step, budget, **options)

    core.device_trees.launch = launch  # type: ignore[method-assign]
    observed: list[float] = []
    real_observe = core.tree_budgets.observe

    def observe(bucket: int, option: int, seconds: float) -> None:
        observed.append(seconds)
        real_observe(bucket, option, seconds)

    core.tree_budgets.observe = observe  # type: ignore[method-assign]
    seqs = [make_sequence(target, prompt, 48, "ddtree") for prompt in prompts]
    for seq in seqs:
        core.add(seq)
    drain(core)
    for seq, prompt in zip(seqs, prompts, strict=True):
        assert seq.error is None and seq.sink.token_ids == run(target, None, prompt, 48)[0]
    assert launches >= 12 and captures >= 3
    assert len(observed) >= 6
    assert max(observed) < 0.25


def test_a_prompt_beyond_the_request_bucket_does_not_break_the_chain_until_it_joins() -> None:
    """Two DDTree requests decode in a chain of device rounds (request bucket 2); a third arrives with a prompt of
    three chunks: the chain goes on while it prefills (no round loaded from the host), and it joins the next rounds
    once decoding (bucket 4, one round loaded); every request gives its greedy tokens alone."""
    target, drafter = golden_pair()
    prompts = random_prompts(3, target.config.vocab_size, seed=53, lengths=(9, 12))
    prompts[2] = random_prompts(1, target.config.vocab_size, seed=54, lengths=(90,))[0]
    core = make_core(target, drafter, max_batch=4, prefill_chunk=32, ddtree_budget=32, eager_padded=True)
    core.policy.plan = lambda *args, **kwargs: True
    core.tree_budgets.forced = True
    assert core.device_trees is not None
    loaded = 0
    real_step = core._device_tree_step

    def counted(rounds: Any) -> int:
        nonlocal loaded
        loaded += 1
        return real_step(rounds)

    core._device_tree_step = counted  # type: ignore[method-assign]
    seqs = [make_sequence(target, prompt, 64, "ddtree") for prompt in prompts]
    for seq in seqs[:2]:
        core.add(seq)
    while core.device_trees.launched is None:
        core.step()
    core.add(seqs[2])
    before = loaded
    steps = 0
    while seqs[2].phase != "decode":
        core.step()
        steps += 1
    assert steps >= 3 and loaded == before  # its three chunks beside the chain's rounds
    core.step()
    core.step()
    assert loaded == before + 1 and core.device_trees.launched is not None
    assert core.device_trees.launched.shape.requests == 4
    drain(core)
    for seq, prompt in zip(seqs, prompts, strict=True):
        assert seq.error is None and seq.sink.token_ids == run(target, None, prompt, 64)[0]
