"""DDTree's tree building, verification inputs and walk for a batch of requests at once, as fixed-shape torch programs
(no host reads: captured in the batched step's graph, `dflash.batch.device_trees`).

The same node set as `dflash.fastpath.device_tree.TreeBuilder` (and so as the host's best-first build, ties aside),
level by level: depth 1 keeps the ``n`` best first tokens, depth ``d+1`` the ``n`` best extensions of depth ``d``'s
kept prefixes (only the (parent, rank) pairs that can rank among the best ``n``), and the tree is the ``n`` best of
every depth's kept prefixes, rows ordered by depth. Every operation runs over all trees together: a step's tree work
is a few dozen kernels whatever the number of requests, where one tree program per request would run them one after
another.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from dflash.speculative.tree import topk_log_probs

log = logging.getLogger("dflash.fastpath")


@dataclass
class TreeBatch:
    """``trees`` trees of ``n`` drafted nodes plus the root (row 0), rows ordered by depth."""

    tokens: torch.Tensor  # [trees, n+1] long; row 0 (the root) holds 0
    depths: torch.Tensor  # [trees, n+1] long, 0 for the root
    parents: torch.Tensor  # [trees, n+1] long, parent row (the root is its own parent)
    valid: torch.Tensor  # [trees, n+1] bool, False for padding candidates and nodes whose parent was not selected
    ancestors: torch.Tensor  # [trees, n+1, n+1] bool, [t, i, j] = j is i or one of its ancestors
    ranks: torch.Tensor  # [trees, n+1] long: a node's rank by score (0: the best), -1 for the root. The c best
    # nodes are the tree of budget c < n (ancestors score at least as high, ties broken by depth first)


class BatchedTreeBuilder:
    """Grows trees of `budget` nodes over `depth` drafted positions, for up to `max_trees` trees at once, and walks
    them: with the Triton programs of `dflash.kernels.triton_tree_batch` (one launch for every tree's growth, one
    for every walk) where they run, else with torch ops."""

    def __init__(
        self, budget: int, depth: int, vocab: int, device: torch.device | str, max_trees: int = 1,
        *, kernel: bool | None = None,
    ) -> None:
        """`kernel`: None to use the Triton programs where they are usable and agree with the torch ops."""
        from dflash.kernels.triton_tree import tree_kernel_usable

        device = torch.device(device)
        self.budget, self.depth, self.k = budget, depth, min(budget, vocab)
        # the extension of depth d's i-th best kept prefix by its r-th best token has (i+1)(r+1) - 1 extensions at
        # least as good: only pairs with (i+1)(r+1) <= budget can rank among the best `budget`
        pairs = [(i, r) for i in range(budget) for r in range(self.k) if (i + 1) * (r + 1) <= budget]
        self.pair_parent = torch.tensor([i for i, _ in pairs], dtype=torch.long, device=device)  # [pairs]
        self.pair_rank = torch.tensor([r for _, r in pairs], dtype=torch.long, device=device)  # [pairs]
        self.first_rank = torch.arange(budget, device=device).clamp(max=self.k - 1)  # [n]
        self.pairs = len(pairs)
        self.kernel = tree_kernel_usable(device) if kernel is None else kernel
        if self.kernel:
            from dflash.kernels.triton_topk import TopKScratch
            from dflash.kernels.triton_tree_batch import BatchGrowScratch

            padded = 1 << max(0, self.pairs - 1).bit_length()  # the programs take a power of two of pairs
            self.pair_parent32 = torch.zeros(padded, dtype=torch.int32, device=device)  # [padded]
            self.pair_rank32 = torch.zeros(padded, dtype=torch.int32, device=device)
            self.pair_parent32[: self.pairs] = self.pair_parent.to(torch.int32)
            self.pair_rank32[: self.pairs] = self.pair_rank.to(torch.int32)
            self.top_lp = torch.zeros((max_trees, depth, self.k), dtype=torch.float32, device=device)
            self.top_ids = torch.zeros((max_trees, depth, self.k), dtype=torch.long, device=device)
            self.topk_scratch = TopKScratch(max_trees * depth, vocab, self.k, device)
            self.grow_scratch = BatchGrowScratch(max_trees, depth, budget, padded, device)
            if kernel is None and not self._kernel_agrees(vocab, device, max_trees):
                self.kernel = False

    def _kernel_agrees(self, vocab: int, device: torch.device, trees: int) -> bool:
        """Grow and walk trees once with the Triton programs and once with torch ops (random logits: no ties, so
        identical rows); a compile failure or a mismatch keeps the torch ops, with a warning."""
        generator = torch.Generator().manual_seed(0)
        logits = torch.randn((trees, self.depth, vocab), generator=generator).to(device)
        follow = torch.rand((trees, self.budget + 1), generator=generator) < 0.8
        smaller = torch.arange(1, self.budget, device=device)
        results = []
        for kernel in (True, False):
            self.kernel = kernel
            try:
                tree = self.grow(logits)  # target choices that follow the tree for a while, then leave it
                choices = torch.where(follow.to(device), tree.tokens.roll(-1, dims=1), 0)
                out = torch.zeros((trees, self.depth + 2 + smaller.shape[0]), dtype=torch.long, device=device)
                path, length = self.walk_into(tree, choices, smaller, out)
            except Exception as exc:  # a Triton build these programs do not compile on
                if not kernel:
                    raise
                log.warning("batched tree kernels unavailable (%s); building trees with torch ops", exc)
                return False
            results.append((*_tree_fields(tree), path, length, out))
        self.kernel = True
        same = all(torch.equal(a, b) for a, b in zip(*results, strict=True))
        if not same:
            log.warning("batched tree kernels disagree with the torch ops; building trees with torch ops")
        return same

    def grow(self, draft_logits: torch.Tensor) -> TreeBatch:
        """draft_logits: [trees, >= depth, vocab] (row d-1 = block position d; unit stride along the vocabulary)
        -> each tree's best `budget` prefixes."""
        trees, depth, n, k = draft_logits.shape[0], self.depth, self.budget, self.k
        device = draft_logits.device
        if self.kernel:
            from dflash.kernels.triton_topk import draft_topk
            from dflash.kernels.triton_tree_batch import tree_grow_batch

            top_lp, top_ids = self.top_lp[:trees], self.top_ids[:trees]  # [trees, depth, k]
            draft_topk(draft_logits[:, :depth], self.topk_scratch, top_lp.view(trees * depth, k),
                       top_ids.view(trees * depth, k))
            return TreeBatch(*tree_grow_batch(
                top_lp, top_ids, self.pair_parent32, self.pair_rank32, self.pairs, self.grow_scratch
            ))
        top_lp, top_ids = topk_log_probs(draft_logits[:, :depth].reshape(trees * depth, -1), k)
        top_lp, top_ids = top_lp.view(trees, depth, k), top_ids.view(trees, depth, k)  # descending
        levels_scores = [torch.full((trees, n), float("-inf"), device=device)]
        levels_scores[0][:, :k] = top_lp[:, 0]
        parent_index = [torch.zeros((trees, n), dtype=torch.long, device=device)]  # into the previous depth's kept
        rank = [self.first_rank[None].expand(trees, n)]  # candidate rank at each depth
        for d in range(1, depth):
            extensions = levels_scores[-1][:, self.pair_parent] + top_lp[:, d, self.pair_rank]  # [trees, pairs]
            best, order = extensions.sort(dim=1, descending=True, stable=True)
            levels_scores.append(best[:, :n])
            parent_index.append(self.pair_parent[order[:, :n]])
            rank.append(self.pair_rank[order[:, :n]])
        return _assemble(torch.stack(levels_scores, 1), torch.stack(parent_index, 1), torch.stack(rank, 1), top_ids)

    def walk_into(
        self, trees: TreeBatch, choices: torch.Tensor, smaller: torch.Tensor, out: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Walk every tree (choices: [trees, >= n+1] long, the target's choice after each row) and write the
        round's outputs, out [trees, depth + 2 + len(smaller)] long: [accepted nodes, the committed tokens (depth +
        1 columns, the accepted nodes' then the bonus), then each budget of `smaller`'s walk length
        (`Walk.lengths_within`)]. Returns (path [trees, depth + 1], length [trees])."""
        depth, n = self.depth, self.budget
        if self.kernel and choices.stride(1) == 1:
            from dflash.kernels.triton_tree_batch import tree_walk_batch

            return tree_walk_batch(trees.tokens, trees.parents, trees.valid, trees.depths, trees.ancestors,
                                   trees.ranks, choices, depth, smaller, out)
        walk = walk_trees(trees, choices[:, : n + 1], depth)
        out[:, 0].copy_(walk.length - 1)
        out[:, 1 : depth + 2].copy_(walk.committed)
        if smaller.numel():
            out[:, depth + 2 :].copy_(walk.lengths_within(trees, smaller))
        return walk.path, walk.length


def _assemble(scores: torch.Tensor, parent_index: torch.Tensor, rank: torch.Tensor, top_ids: torch.Tensor) -> TreeBatch:
    """scores, parent_index, rank: [trees, depth, n] (each depth's kept prefixes: score, parent's index among the
    previous depth's kept, candidate rank); top_ids: [trees, depth, k] -> the best n of them as tree rows."""
    trees, depth, n = scores.shape
    device = scores.device
    flat_scores = scores.reshape(trees, depth * n)  # flat index = (d-1) * n + j
    by_score = flat_scores.sort(dim=1, descending=True, stable=True).indices[:, :n]  # [trees, n]
    chosen, ranks = by_score.sort(dim=1)  # [trees, n]: flat indices ascending (rows by depth), each one's rank
    level_offsets = (torch.arange(depth, device=device) - 1)[:, None] * n  # [depth, 1]
    flat_parent = torch.where(level_offsets < 0, -1, level_offsets + parent_index).reshape(trees, depth * n)
    row_of = torch.full((trees, depth * n), -1, dtype=torch.long, device=device)
    row_of.scatter_(1, chosen, torch.arange(1, n + 1, device=device)[None].expand(trees, n))
    parent_flat = flat_parent.gather(1, chosen)  # [trees, n]
    parent_row = torch.where(parent_flat < 0, 0, row_of.gather(1, parent_flat.clamp(min=0)))  # -1: not selected
    valid = torch.isfinite(flat_scores.gather(1, chosen)) & (parent_row >= 0)  # [trees, n]
    zero = torch.zeros((trees, 1), dtype=torch.long, device=device)
    parents = torch.cat((zero, parent_row.clamp(min=0)), 1)  # [trees, n+1]
    tokens = torch.cat((zero, top_ids.gather(2, rank).reshape(trees, depth * n).gather(1, chosen)), 1)
    depths = torch.cat((zero, torch.div(chosen, n, rounding_mode="floor") + 1), 1)
    valid = torch.cat((torch.ones((trees, 1), dtype=torch.bool, device=device), valid), 1)
    # ancestor-or-self closure of the parent relation by repeated squaring: paths up to `depth` long
    reach = torch.eye(n + 1, device=device).repeat(trees, 1, 1)  # [trees, n+1, n+1]
    reach.scatter_(2, parents[:, :, None], 1.0)
    hops = 1
    while hops < depth:
        reach = torch.bmm(reach, reach).clamp_(max=1.0)
        hops *= 2
    ranks = torch.cat((zero - 1, ranks), 1)  # [trees, n+1]
    return TreeBatch(tokens, depths, parents, valid, reach > 0, ranks)


def _tree_fields(trees: TreeBatch) -> tuple[torch.Tensor, ...]:
    return trees.tokens, trees.depths, trees.parents, trees.valid, trees.ancestors, trees.ranks


def write_tree_inputs(
    trees: TreeBatch, pending: torch.Tensor, past: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor,
    visibility: torch.Tensor,
) -> None:
    """Each tree as its verification's rows: pending, past [trees] long (the committed token and length) ->
    input_ids[:, :n+1] = [pending, node tokens], positions[:, :n+1] = past + depths (input_ids, positions:
    [trees, rows] long, rows >= n+1), visibility [trees, rows, rows] bool = the ancestor relation, padding rows
    seeing only themselves."""
    nodes, rows = trees.tokens.shape[1], visibility.shape[1]
    input_ids[:, :1].copy_(pending[:, None])
    input_ids[:, 1:nodes].copy_(trees.tokens[:, 1:])
    positions[:, :nodes].copy_(past[:, None] + trees.depths)
    visibility.copy_(torch.eye(rows, dtype=torch.bool, device=visibility.device).expand_as(visibility))
    visibility[:, :nodes, :nodes].copy_(trees.ancestors)


@dataclass
class Walk:
    path: torch.Tensor  # [trees, depth+1] rows from the root (row 0 past a path's end)
    length: torch.Tensor  # [trees]: accepted nodes + 1
    committed: torch.Tensor  # [trees, depth+1]: the accepted nodes' tokens then the bonus token (unspecified after)
    accepted: torch.Tensor  # [trees, n+1] bool: the root and the accepted nodes

    def lengths_within(self, trees: TreeBatch, budgets: torch.Tensor) -> torch.Tensor:
        """budgets [count] long on the trees' device (below the trees' own) -> [trees, count]: the length each
        tree's walk would have had with a tree of only its best `budget` nodes: the accepted path's nodes ranked
        below it (ranks grow along a path)."""
        inside = (trees.ranks[:, :, None] < budgets) & self.accepted[:, :, None]  # [trees, n+1, count]
        return inside.sum(dim=1)  # the root's rank -1 counts it under every budget


def walk_trees(trees: TreeBatch, choices: torch.Tensor, depth: int) -> Walk:
    """choices: [trees, n+1] long, the target's choice after each row -> each tree's walk. Siblings carry distinct
    tokens, so the accepted nodes (every node on the path carries the choice at its parent) form one path from the
    root."""
    count, rows = trees.tokens.shape
    device = choices.device
    is_root = torch.arange(rows, device=device)[None] == 0
    match = ((trees.tokens == choices.gather(1, trees.parents)) & trees.valid) | is_root  # [trees, n+1]
    accepted = ~(trees.ancestors & ~match[:, None, :]).any(dim=-1)  # [trees, n+1]
    length = accepted.sum(dim=1)  # [trees], >= 1 (the root)
    slot = torch.where(accepted, trees.depths, depth + 1)  # rejected rows go to a last, discarded slot
    path = torch.zeros((count, depth + 2), dtype=torch.long, device=device)
    path.scatter_(1, slot, torch.arange(rows, device=device)[None].expand(count, rows))
    path = path[:, : depth + 1]
    bonus = choices.gather(1, path.gather(1, (length - 1)[:, None]))  # [trees, 1]
    steps = torch.arange(depth + 1, device=device)[None]  # [1, depth+1]
    next_rows = path.gather(1, (steps + 1).clamp(max=depth).expand(count, depth + 1))
    committed = torch.where(steps < (length - 1)[:, None], trees.tokens.gather(1, next_rows), bonus)
    return Walk(path, length, committed, accepted)


class BatchedChainBuilder(BatchedTreeBuilder):
    """Linear DFlash's chains for a batch of requests as trees of one path: node d the drafter's argmax at block
    position d, its parent node d - 1; walked by the trees' walk. A chain's first c nodes are its best c (ranks by
    depth), so each round also tells what every shorter chain would have committed (`Walk.lengths_within`)."""

    def __init__(
        self, length: int, vocab: int, device: torch.device | str, max_trees: int = 1, *, kernel: bool | None = None
    ) -> None:
        device = torch.device(device)
        rows = torch.arange(length + 1, device=device)  # [n+1]
        self._depths = rows[None].repeat(max_trees, 1)  # [max_trees, n+1]
        self._parents = (rows - 1).clamp(min=0)[None].repeat(max_trees, 1)
        self._valid = torch.ones((max_trees, length + 1), dtype=torch.bool, device=device)
        self._ancestors = (rows[None, :] <= rows[:, None])[None].repeat(max_trees, 1, 1)  # [max_trees, n+1, n+1]
        self._ranks = (rows - 1)[None].repeat(max_trees, 1)  # the root -1
        super().__init__(length, length, vocab, device, max_trees, kernel=kernel)

    def grow(self, draft_logits: torch.Tensor) -> TreeBatch:
        """draft_logits: [trees, >= length, vocab] -> each request's chain of argmax tokens."""
        trees, length = draft_logits.shape[0], self.depth
        best = draft_logits[:, :length].argmax(dim=-1)  # [trees, length]
        tokens = torch.cat((best.new_zeros(trees, 1), best), 1)  # [trees, length + 1]
        return TreeBatch(tokens, self._depths[:trees], self._parents[:trees], self._valid[:trees],
                         self._ancestors[:trees], self._ranks[:trees])
