"""Trees grown, laid out and walked for a batch of requests at once (`dflash.fastpath.batched_trees`) equal the
single-tree device programs' torch form (`dflash.fastpath.device_tree`), tree by tree; chains (one-path trees) walk
as linear verification does."""

from __future__ import annotations

import pytest
import torch

from dflash.fastpath.batched_trees import (
    BatchedChainBuilder,
    BatchedTreeBuilder,
    walk_trees,
    write_tree_inputs,
)
from dflash.fastpath.device_tree import TreeBuilder, walk_tree


@pytest.mark.parametrize(("budget", "depth"), [(6, 4), (31, 15), (12, 1)])
def test_a_batch_of_trees_equals_each_tree_grown_and_walked_alone(budget: int, depth: int) -> None:
    generator = torch.Generator().manual_seed(budget)
    trees, vocab = 5, 300
    logits = torch.randn((trees, depth + 2, vocab), generator=generator)  # rows past `depth` are not read
    batched = BatchedTreeBuilder(budget, depth, vocab, "cpu")
    single = TreeBuilder(budget, depth, vocab, "cpu", kernel=False)
    grown = batched.grow(logits)
    # target choices that follow each tree for a while, then leave it
    follow = torch.rand((trees, budget + 1), generator=generator) < 0.8
    choices = torch.where(follow, grown.tokens.roll(-1, dims=1), 0)
    walk = walk_trees(grown, choices, depth)
    paths, lengths, committed = walk.path, walk.length, walk.committed
    assert (lengths > 1).any()  # some walks accept nodes
    for index in range(trees):
        tree = single.grow(logits[index, :depth])
        assert torch.equal(grown.tokens[index], tree.tokens)
        assert torch.equal(grown.depths[index], tree.depths)
        assert torch.equal(grown.parents[index], tree.parents)
        assert torch.equal(grown.valid[index], tree.valid)
        assert torch.equal(grown.ancestors[index], tree.ancestors)
        path, length, _, expected = walk_tree(tree, choices[index], depth)
        assert int(lengths[index]) == int(length)
        kept = int(length)
        assert torch.equal(paths[index, :kept], path[:kept])
        assert torch.equal(committed[index, :kept], expected[:kept])


def test_tree_inputs_are_each_tree_s_rows_and_ancestor_mask() -> None:
    budget, depth, vocab, rows = 6, 3, 50, 8
    builder = BatchedTreeBuilder(budget, depth, vocab, "cpu")
    grown = builder.grow(torch.randn((2, depth, vocab), generator=torch.Generator().manual_seed(3)))
    pending, past = torch.tensor([7, 9]), torch.tensor([20, 41])
    ids, positions = torch.full((2, rows), -1), torch.full((2, rows), -1)
    visibility = torch.zeros((2, rows, rows), dtype=torch.bool)
    write_tree_inputs(grown, pending, past, ids, positions, visibility)
    for index in range(2):
        assert ids[index, 0] == pending[index]
        assert torch.equal(ids[index, 1 : budget + 1], grown.tokens[index, 1:])
        assert torch.equal(positions[index, : budget + 1], past[index] + grown.depths[index])
        assert torch.equal(visibility[index, : budget + 1, : budget + 1], grown.ancestors[index])
        assert torch.equal(visibility[index, budget + 1 :], torch.eye(rows, dtype=torch.bool)[budget + 1 :])


def _prefix_choices(trees: object, top_ids: torch.Tensor) -> torch.Tensor:
    """A target whose choice after a row depends only on the row's token prefix: one of the drafter's three best
    tokens at the next depth, picked by a hash of the prefix -> choices [trees, n+1]."""
    tokens, parents, depths = trees.tokens, trees.parents, trees.depths  # type: ignore[attr-defined]
    count, rows = tokens.shape
    choices = torch.zeros((count, rows), dtype=torch.long)
    for t in range(count):
        for row in range(rows):
            prefix, node = [], row
            while node != 0:
                prefix.append(int(tokens[t, node]))
                node = int(parents[t, node])
            depth = int(depths[t, row])
            if depth < top_ids.shape[1]:
                pick = sum((i + 3) * token for i, token in enumerate(prefix)) % 3
                choices[t, row] = top_ids[t, depth, pick]
    return choices


@pytest.mark.parametrize("seed", [0, 1])
def test_lengths_within_smaller_budgets_equal_walking_the_smaller_trees(seed: int) -> None:
    """A walk's length under each smaller budget (from the nodes' score ranks) is the length of walking the tree
    actually grown with that budget from the same logits, against the same target."""
    generator = torch.Generator().manual_seed(seed)
    count, depth, vocab, budget = 6, 7, 40, 31
    logits = torch.randn((count, depth, vocab), generator=generator) * 3
    top_ids = logits.topk(3, dim=-1).indices  # [trees, depth, 3]
    grown = BatchedTreeBuilder(budget, depth, vocab, "cpu").grow(logits)
    walk = walk_trees(grown, _prefix_choices(grown, top_ids), depth)
    smaller = [3, 7, 15]
    within = walk.lengths_within(grown, torch.tensor(smaller))  # [trees, 3]
    assert (within[:, -1] > 1).any() and not torch.equal(within[:, 0], walk.length)
    for column, small in enumerate(smaller):
        tree = BatchedTreeBuilder(small, min(depth, small), vocab, "cpu").grow(logits)
        expected = walk_trees(tree, _prefix_choices(tree, top_ids), min(depth, small)).length
        assert torch.equal(within[:, column], expected)


def test_chains_are_the_argmax_paths_and_walk_as_linear_verification() -> None:
    """A chain is the drafter's argmax at each position; its walk accepts the drafts up to the first the target's
    choice differs from, then the bonus token, and reports what each shorter chain would have committed."""
    generator = torch.Generator().manual_seed(3)
    trees, length, vocab = 4, 6, 50
    logits = torch.randn((trees, length + 2, vocab), generator=generator)
    builder = BatchedChainBuilder(length, vocab, "cpu", trees)
    chains = builder.grow(logits)
    drafts = logits[:, :length].argmax(dim=-1)  # [trees, length]
    assert torch.equal(chains.tokens[:, 1:], drafts)
    assert torch.equal(chains.parents[0], torch.tensor([0, 0, 1, 2, 3, 4, 5]))
    assert torch.equal(chains.ancestors[0], torch.ones(length + 1, length + 1).tril().bool())
    # the target agrees with the first `agree` drafts of each chain, then picks another token
    agree = [0, 2, 5, 6]
    choices = torch.zeros((trees, length + 1), dtype=torch.long)
    for index, count in enumerate(agree):
        choices[index, :length] = drafts[index]
        if count < length:
            choices[index, count] = (drafts[index, count] + 1) % vocab
        choices[index, length] = 7
    smaller = torch.tensor([1, 3])
    out = torch.zeros((trees, length + 2 + 2), dtype=torch.long)
    builder.walk_into(chains, choices, smaller, out)
    for index, count in enumerate(agree):
        assert int(out[index, 0]) == count
        committed = [*drafts[index, :count].tolist(), int(choices[index, count])]
        assert out[index, 1 : count + 2].tolist() == committed
        assert out[index, length + 2 :].tolist() == [min(count, 1) + 1, min(count, 3) + 1]
