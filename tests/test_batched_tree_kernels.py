"""The batched trees' Triton programs (`dflash.kernels.triton_tree_batch`, top-k over several trees' rows in
`dflash.kernels.triton_topk`) equal the torch ops of `dflash.fastpath.batched_trees`, field by field."""

from __future__ import annotations

import pytest
import torch

from dflash.fastpath.batched_trees import BatchedChainBuilder, BatchedTreeBuilder, TreeBatch
from dflash.kernels.triton_tree import tree_kernel_usable

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(not tree_kernel_usable(DEVICE), reason="needs Triton (a GPU, or TRITON_INTERPRET=1)")


def _fields(trees: TreeBatch) -> dict[str, torch.Tensor]:
    return {"tokens": trees.tokens, "depths": trees.depths, "parents": trees.parents, "valid": trees.valid,
            "ancestors": trees.ancestors, "ranks": trees.ranks}


def _builders(budget: int, depth: int, vocab: int, trees: int) -> tuple[BatchedTreeBuilder, BatchedTreeBuilder]:
    fast = BatchedTreeBuilder(budget, depth, vocab, DEVICE, trees, kernel=True)
    reference = BatchedTreeBuilder(budget, depth, vocab, DEVICE, trees, kernel=False)
    return fast, reference


@pytest.mark.parametrize(("budget", "depth", "trees", "block"), [(7, 7, 3, 15), (15, 15, 2, 15), (31, 15, 4, 15),
                                                                 (5, 3, 1, 4)])
def test_every_tree_grown_and_walked_in_one_launch_equals_the_torch_ops(
    budget: int, depth: int, trees: int, block: int
) -> None:
    """Random drafter logits (no ties) over blocks longer than the tree's depth (the programs read each tree's
    first `depth` rows); the target follows each tree for a while, then leaves it. Every field of the trees (ranks
    included), the paths, lengths and the round's output rows (accepted, committed tokens, lengths within smaller
    budgets) are equal."""
    generator = torch.Generator().manual_seed(budget + trees)
    vocab = 300
    logits = torch.randn((trees, block, vocab), generator=generator).to(DEVICE)
    fast, reference = _builders(budget, depth, vocab, trees + 1)  # room for one tree more than grown
    grown, expected = fast.grow(logits), reference.grow(logits)
    for name, tensor in _fields(expected).items():
        assert torch.equal(_fields(grown)[name], tensor), name
    follow = torch.rand((trees, budget + 1), generator=generator) < 0.8
    follow[:, 0] = True  # every tree accepts its first row's node
    follow = follow.to(DEVICE)
    choices = torch.zeros((trees, budget + 9), dtype=torch.long, device=DEVICE)  # padded rows, as the step's
    choices[:, : budget + 1] = torch.where(follow, expected.tokens.roll(-1, dims=1), 0)
    smaller = torch.tensor([b for b in (3, 7, 15) if b < budget], dtype=torch.long, device=DEVICE)
    columns = depth + 2 + smaller.shape[0]
    out = torch.full((trees, columns), -5, dtype=torch.long, device=DEVICE)
    out_expected = torch.full((trees, columns), -5, dtype=torch.long, device=DEVICE)
    path, length = fast.walk_into(grown, choices, smaller, out)
    path_expected, length_expected = reference.walk_into(expected, choices, smaller, out_expected)
    assert (length_expected > 1).all()
    assert torch.equal(length, length_expected)
    assert torch.equal(out, out_expected)
    for index in range(trees):  # past its length a path holds row 0 in both forms
        assert torch.equal(path[index], path_expected[index])


def test_top_k_over_several_trees_rows_equals_each_tree_s_own() -> None:
    """Rows given as [trees, rows, vocab] with fewer rows read than the block holds: the same log-probabilities and
    ids as each tree's rows alone."""
    from dflash.kernels.triton_topk import TopKScratch, draft_topk

    generator = torch.Generator().manual_seed(5)
    trees, block, depth, vocab, k = 3, 6, 4, 5000, 7
    logits = torch.randn((trees, block, vocab), generator=generator).to(DEVICE, torch.bfloat16)
    log_probs = torch.zeros((trees * depth, k), dtype=torch.float32, device=DEVICE)
    ids = torch.zeros((trees * depth, k), dtype=torch.long, device=DEVICE)
    draft_topk(logits[:, :depth], TopKScratch(trees * depth, vocab, k, DEVICE), log_probs, ids)
    for index in range(trees):
        own_lp = torch.zeros((depth, k), dtype=torch.float32, device=DEVICE)
        own_ids = torch.zeros((depth, k), dtype=torch.long, device=DEVICE)
        draft_topk(logits[index, :depth], TopKScratch(depth, vocab, k, DEVICE), own_lp, own_ids)
        assert torch.equal(log_probs[index * depth : (index + 1) * depth], own_lp)
        assert torch.equal(ids[index * depth : (index + 1) * depth], own_ids)


def test_the_builder_checks_its_programs_against_the_torch_ops() -> None:
    """Left to choose, the builder runs the programs once against the torch ops and keeps them where they agree."""
    builder = BatchedTreeBuilder(7, 7, 200, DEVICE, 2)
    assert builder.kernel


@pytest.mark.parametrize("length", [3, 15])
def test_chains_walked_by_the_program_equal_the_torch_ops(length: int) -> None:
    """One-path trees (linear rounds' chains) through the walk program: the same round outputs as the torch ops."""
    generator = torch.Generator().manual_seed(length)
    trees, vocab = 3, 300
    logits = torch.randn((trees, 15, vocab), generator=generator).to(DEVICE)
    fast = BatchedChainBuilder(length, vocab, DEVICE, trees, kernel=True)
    reference = BatchedChainBuilder(length, vocab, DEVICE, trees, kernel=False)
    chains = reference.grow(logits)
    follow = torch.rand((trees, length + 1), generator=generator) < 0.85
    follow[:, 0] = True
    choices = torch.where(follow.to(DEVICE), chains.tokens.roll(-1, dims=1), 0)
    smaller = torch.tensor([c for c in (3, 7) if c < length], dtype=torch.long, device=DEVICE)
    out = torch.full((trees, length + 2 + smaller.shape[0]), -5, dtype=torch.long, device=DEVICE)
    out_expected = out.clone()
    fast.walk_into(fast.grow(logits), choices, smaller, out)
    reference.walk_into(chains, choices, smaller, out_expected)
    assert (out_expected[:, 0] > 0).all()
    assert torch.equal(out, out_expected)
