"""The device tree builder and walk (`dflash.fastpath.device_tree`) against the host's best-first tree and walk."""

from __future__ import annotations

import pytest
import torch

from dflash.fastpath.device_tree import DeviceTree, TreeBuilder, walk_tree
from dflash.kernels.triton_tree import tree_kernel_usable
from dflash.speculative.tree import build_tree, follow_tree, topk_log_probs, tree_from_parents


def token_paths(tokens: list[int], parents: list[int], valid: list[bool] | None = None) -> set[tuple[int, ...]]:
    """Every node as the token path from the root (the node identity both builders share)."""
    paths = set()
    for node in range(1, len(tokens)):
        if valid is not None and not valid[node]:
            continue
        path, at = [], node
        while at != 0:
            path.append(tokens[at])
            at = parents[at]
        paths.add(tuple(reversed(path)))
    return paths


def random_case(
    generator: torch.Generator, min_vocab: int, budgets: tuple[int, ...] | None = None
) -> tuple[torch.Tensor, int]:
    """Random logits [depth, vocab] and a budget (from `budgets` when given: each budget is a kernel variant to
    compile on a GPU)."""
    depth = int(torch.randint(1, 16, (1,), generator=generator))
    vocab = int(torch.randint(min_vocab, 300, (1,), generator=generator))
    budget = int(torch.randint(1, 40, (1,), generator=generator))
    if budgets is not None:
        budget = budgets[budget % len(budgets)]
    scale = float(torch.rand(1, generator=generator)) * 6
    return torch.randn(depth, vocab, generator=generator) * scale, budget


DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
KERNEL = pytest.param(
    True, marks=pytest.mark.skipif(not tree_kernel_usable(DEVICE), reason="needs Triton (a GPU, or TRITON_INTERPRET=1)")
)


@pytest.mark.parametrize("kernel", [False, KERNEL], ids=["torch", "triton"])
def test_the_device_tree_holds_the_host_trees_nodes(kernel: bool) -> None:
    """Same node set as `build_tree` (random logits: no exact ties), small vocabularies (K < budget) included."""
    generator = torch.Generator().manual_seed(0)
    for _ in range(40 if kernel else 150):  # each kernel case also checks itself against torch ops
        logits, budget = random_case(generator, min_vocab=2, budgets=(1, 5, 16, 32) if kernel else None)
        host = build_tree(logits, budget)
        builder = TreeBuilder(budget, logits.shape[0], logits.shape[1], DEVICE, kernel=kernel)
        assert builder.kernel == kernel  # the kernels agreed with torch ops on their own check
        device = builder.grow(logits.to(DEVICE))
        host_paths = token_paths([0, *host.token_ids.tolist()], host.parents.tolist())
        device_paths = token_paths(device.tokens.tolist(), device.parents.tolist(), device.valid.tolist())
        assert device_paths == host_paths
        depths = device.depths.tolist()
        parents = device.parents.tolist()
        assert all(parents[i] < i and depths[parents[i]] == depths[i] - 1 for i in range(1, len(depths)))
        ancestors = device.ancestors
        for i in range(len(depths)):  # ancestors = the parent chain, and self
            chain, at = {i}, i
            while at != 0:
                at = parents[at]
                chain.add(at)
            assert set(ancestors[i].nonzero().flatten().tolist()) == chain


def choices_for(tree: DeviceTree, vocab: int, generator: torch.Generator) -> torch.Tensor:
    """Target choices that follow a child most of the time (long accepted paths), a random token otherwise."""
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    choices = []
    for node in range(len(tokens)):
        children = [tokens[c] for c in range(1, len(tokens)) if parents[c] == node]
        if children and float(torch.rand(1, generator=generator)) < 0.8:
            choices.append(children[int(torch.randint(len(children), (1,), generator=generator))])
        else:
            choices.append(int(torch.randint(vocab, (1,), generator=generator)))
    return torch.tensor(choices)


@pytest.mark.parametrize("kernel", [False, KERNEL], ids=["torch", "triton"])
def test_the_device_walk_follows_the_host_walk(kernel: bool) -> None:
    generator = torch.Generator().manual_seed(1)
    lengths = []
    for _ in range(60 if kernel else 200):
        logits, budget = random_case(generator, min_vocab=40, budgets=(5, 16, 32) if kernel else None)
        depth, vocab = logits.shape
        builder = TreeBuilder(budget, depth, vocab, DEVICE, kernel=kernel)
        assert builder.kernel == kernel
        tree = builder.grow(logits.to(DEVICE))
        tokens = tree.tokens.tolist()
        host_tree = tree_from_parents(tokens[1:], [-1, *tree.parents.tolist()[1:]])
        choices = choices_for(tree, vocab, generator)
        visited, bonus = follow_tree(host_tree, choices)
        path, length, device_bonus, committed = builder.walk(tree, choices.to(DEVICE))
        assert torch.equal(path, walk_tree(tree, choices.to(DEVICE), depth)[0])
        count = int(length)
        assert path[:count].tolist() == visited
        assert int(device_bonus) == bonus
        assert committed[:count].tolist() == [tokens[i] for i in visited[1:]] + [bonus]
        lengths.append(count)
    assert max(lengths) >= 5  # long paths were walked


@pytest.mark.parametrize("budget", [1, 7, 32])
def test_a_single_position_gives_the_best_first_tokens(budget: int) -> None:
    logits = torch.randn(1, 100, generator=torch.Generator().manual_seed(2))
    tree = TreeBuilder(budget, 1, 100, logits.device).grow(logits)  # [1 position, 100 tokens]
    assert tree.tokens[1:].tolist() == logits[0].topk(budget).indices.tolist()
    assert tree.depths[1:].tolist() == [1] * budget


def test_a_kernel_that_fails_leaves_the_torch_path(monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    import dflash.kernels.triton_tree as triton_tree

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("no compiler")

    monkeypatch.setattr(triton_tree, "tree_grow", broken)
    builder = TreeBuilder(8, 4, 50, "cpu", kernel=True)
    assert not builder.kernel
    assert "tree kernels unavailable" in caplog.text
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(3))
    host = build_tree(logits, 8)
    tree = builder.grow(logits)
    assert token_paths(tree.tokens.tolist(), tree.parents.tolist()) == token_paths(
        [0, *host.token_ids.tolist()], host.parents.tolist()
    )


@pytest.mark.skipif(not tree_kernel_usable(DEVICE), reason="needs Triton (a GPU, or TRITON_INTERPRET=1)")
@pytest.mark.parametrize(("rows", "vocab", "k"), [(3, 700, 5), (2, 2600, 32), (1, 40, 40)])
def test_the_top_k_program_matches_torch(rows: int, vocab: int, k: int) -> None:
    """`draft_topk` against `topk_log_probs`: the same tokens in the same order (random logits, no ties) and the
    same log-probabilities up to the logsumexp's summation order; segments of fewer than k entries included."""
    from dflash.kernels.triton_topk import TopKScratch, draft_topk

    logits = (torch.randn(rows, vocab, generator=torch.Generator().manual_seed(vocab)) * 4).to(DEVICE)
    log_probs = torch.empty((rows, k), device=DEVICE)
    ids = torch.empty((rows, k), dtype=torch.long, device=DEVICE)
    draft_topk(logits, TopKScratch(rows, vocab, k, DEVICE), log_probs, ids)
    expected_lp, expected_ids = topk_log_probs(logits, k)
    assert torch.equal(ids, expected_ids)
    torch.testing.assert_close(log_probs, expected_lp, rtol=0, atol=1e-5)


@pytest.mark.skipif(not tree_kernel_usable(DEVICE), reason="needs Triton (a GPU, or TRITON_INTERPRET=1)")
def test_the_top_k_program_breaks_ties_by_token_id() -> None:
    from dflash.kernels.triton_topk import TopKScratch, draft_topk

    logits = torch.zeros(1, 3000, device=DEVICE)
    logits[0, [2500, 7, 1200]] = 1.0  # three equal maxima in different segments
    log_probs = torch.empty((1, 5), device=DEVICE)
    ids = torch.empty((1, 5), dtype=torch.long, device=DEVICE)
    draft_topk(logits, TopKScratch(1, 3000, 5, DEVICE), log_probs, ids)
    assert ids[0].tolist() == [7, 1200, 2500, 0, 1]


@pytest.mark.parametrize("kernel", [False, KERNEL], ids=["torch", "triton"])
def test_the_walk_writes_the_resident_round_outputs(kernel: bool) -> None:
    """With round outputs the walk also writes [accepted, committed...], the bonus as the next pending token and
    accepted + 1 as the drafter's new rows, the same values it returns."""
    generator = torch.Generator().manual_seed(3)
    for _ in range(10):
        logits, budget = random_case(generator, min_vocab=40, budgets=(16, 32))
        depth, vocab = logits.shape
        builder = TreeBuilder(budget, depth, vocab, DEVICE, kernel=kernel)
        tree = builder.grow(logits.to(DEVICE))
        choices = choices_for(tree, vocab, generator).to(DEVICE)
        out = torch.full((depth + 2,), -5, dtype=torch.long, device=DEVICE)
        pending = torch.zeros(1, dtype=torch.long, device=DEVICE)
        new_rows = torch.zeros(1, dtype=torch.long, device=DEVICE)
        path, length, bonus, committed = builder.walk(tree, choices, (out, pending, new_rows))
        assert int(out[0]) == int(length) - 1
        assert torch.equal(out[1:], committed)
        assert int(pending) == int(bonus) and int(new_rows) == int(length)
        assert torch.equal(path, walk_tree(tree, choices, depth)[0])


@pytest.mark.parametrize("kernel", [False, KERNEL], ids=["torch", "triton"])
def test_writing_a_tree_as_verification_inputs(kernel: bool) -> None:
    """input_ids = [pending, node tokens], positions = length + depths over the tree's rows (the rows past them are
    left alone), the mask = the ancestor relation with padding rows seeing only themselves."""
    generator = torch.Generator().manual_seed(4)
    for budget, rows in ((5, 8), (16, 24), (32, 40)):
        logits = torch.randn(15, 300, generator=generator) * 3
        builder = TreeBuilder(budget, 15, 300, DEVICE, kernel=kernel)
        tree = builder.grow(logits.to(DEVICE))
        input_ids = torch.full((rows,), -1, dtype=torch.long, device=DEVICE)
        positions = torch.full((rows,), -1, dtype=torch.long, device=DEVICE)
        mask = torch.zeros((rows, rows), dtype=torch.bool, device=DEVICE)
        pending, length = torch.tensor([77], device=DEVICE), torch.tensor([120], device=DEVICE)
        builder.write_inputs(tree, pending, length, input_ids, positions, mask)
        nodes = budget + 1
        assert input_ids[0] == 77 and torch.equal(input_ids[1:nodes], tree.tokens[1:])
        assert torch.equal(positions[:nodes], 120 + tree.depths)
        assert (input_ids[nodes:] == -1).all() and (positions[nodes:] == -1).all()
        expected = torch.eye(rows, dtype=torch.bool, device=DEVICE)
        expected[:nodes, :nodes] = tree.ancestors
        assert torch.equal(mask, expected)
