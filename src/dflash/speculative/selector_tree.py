"""DDTree trees grown from DFlash2's candidate selector instead of independent per-position marginals.

The selector scores a row's candidates given the token before them, so a child's log-probability depends on its
parent's token: log_softmax over the row's K candidates of S_d(parent token, .). The tree keeps the `budget`
best-scoring prefixes (a prefix scores the sum of its tokens' log-probabilities), grown best-first from a heap as
`dflash.speculative.tree.build_tree` does. Verification is DDTree's own, so decoding stays lossless.
"""

from __future__ import annotations

import heapq

import torch

from dflash.drafter.selector import CandidateLattice
from dflash.speculative.tree import DraftTree, tree_from_parents


def selector_tree(lattice: CandidateLattice, anchor: int, budget: int, max_depth: int | None = None) -> DraftTree:
    """The best-first tree of at most `budget` nodes (root = `anchor`, the pending token) and `max_depth` levels
    (default: the lattice's rows). Equal scores leave the heap in the order they entered it."""
    depth_limit = lattice.rows if max_depth is None else min(max_depth, lattice.rows)
    tokens: list[int] = []
    parents = [-1]
    heap: list[tuple[float, int, int, int, int]] = []  # (-score, order, parent node, depth, token)
    order = 0

    def push_children(node: int, depth: int, token: int, score: float) -> None:
        nonlocal order
        if depth >= depth_limit:
            return
        log_probs = torch.log_softmax(lattice.scores(depth, token), dim=-1).tolist()  # [K]
        for candidate, log_prob in zip(lattice.candidates[depth].tolist(), log_probs, strict=True):
            heapq.heappush(heap, (-(score + log_prob), order, node, depth + 1, candidate))
            order += 1

    push_children(0, 0, anchor, 0.0)
    while heap and len(tokens) < budget:
        negative, _, parent, depth, token = heapq.heappop(heap)
        tokens.append(token)
        parents.append(parent)
        push_children(len(tokens), depth, token, -negative)
    return tree_from_parents(tokens, parents)
