"""The device tree builder and walk (`dflash.fastpath.device_tree`) against the host's best-first tree and walk."""

from __future__ import annotations

import pytest
import torch

from dflash.fastpath.device_tree import DeviceTree, TreeBuilder, grow_tree, walk_tree
from dflash.kernels.triton_tree import tree_kernel_usable
from dflash.spec.tree import build_tree, follow_tree, tree_from_parents


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
    for _ in range(150):
        logits, budget = random_case(generator, min_vocab=2, budgets=(1, 5, 16, 32) if kernel else None)
        host = build_tree(logits, budget)
        device = grow_tree(logits.to(DEVICE), budget, kernel=kernel)
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


def test_the_device_walk_follows_the_host_walk() -> None:
    generator = torch.Generator().manual_seed(1)
    lengths = []
    for _ in range(200):
        logits, budget = random_case(generator, min_vocab=40)
        depth = logits.shape[0]
        tree = grow_tree(logits, budget)
        tokens = tree.tokens.tolist()
        host_tree = tree_from_parents(tokens[1:], [-1, *tree.parents.tolist()[1:]])
        choices = choices_for(tree, logits.shape[1], generator)
        visited, bonus = follow_tree(host_tree, choices)
        path, length, device_bonus, committed = walk_tree(tree, choices, depth)
        count = int(length)
        assert path[:count].tolist() == visited
        assert int(device_bonus) == bonus
        assert committed[:count].tolist() == [tokens[i] for i in visited[1:]] + [bonus]
        lengths.append(count)
    assert max(lengths) >= 5  # long paths were walked


@pytest.mark.parametrize("budget", [1, 7, 32])
def test_a_single_position_gives_the_best_first_tokens(budget: int) -> None:
    logits = torch.randn(1, 100, generator=torch.Generator().manual_seed(2))
    tree = grow_tree(logits, budget)
    assert tree.tokens[1:].tolist() == logits[0].topk(budget).indices.tolist()
    assert tree.depths[1:].tolist() == [1] * budget


def test_a_kernel_that_fails_leaves_the_torch_path(monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    import dflash.kernels.triton_tree as triton_tree

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("no compiler")

    monkeypatch.setattr(triton_tree, "tree_levels", broken)
    builder = TreeBuilder(8, 4, 50, "cpu", kernel=True)
    assert not builder.kernel
    assert "tree kernel unavailable" in caplog.text
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(3))
    host = build_tree(logits, 8)
    tree = builder.grow(logits)
    assert token_paths(tree.tokens.tolist(), tree.parents.tolist()) == token_paths(
        [0, *host.token_ids.tolist()], host.parents.tolist()
    )
