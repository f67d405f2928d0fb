"""DDTree's tree building and tree walk as fixed-shape device tensor programs (no host reads), for graph capture.

`dflash.speculative.tree` builds the tree best-first from a heap on the host; these functions pick the same node set
without a heap, level by level:

* depth 1 keeps the ``n`` best first tokens; depth ``d+1`` keeps the ``n`` best extensions of depth ``d``'s kept
  prefixes (K = min(n, vocab) candidates per depth, true log-softmax scores as in the host version; only the
  extensions that can rank among the ``n`` best are scored, see `TreeBuilder`);
* the tree is the ``n`` best-scoring prefixes over every depth's kept ones.

Why that is the host's set: a score never increases along a path, so the ``n`` best prefixes are prefix-closed;
each best prefix of depth ``d`` has its parent among depth ``d-1``'s kept ones (induction) and at most ``n - 1``
better prefixes of its own depth, so it is kept at its depth and selected at the end. Exact score ties may break
differently (the host orders them by rank tuples); a selected node whose parent was not selected (only possible
on such a tie) is marked invalid and never accepted. Rows are ordered by depth (parents precede children), not in
the host's pop order: the verification does not depend on the order.

The walk accepts node ``i`` when every node on its path (itself included, the root excluded) carries the token the
target chose at its parent; siblings carry distinct tokens, so the accepted nodes form one path from the root.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from dflash.speculative.tree import topk_log_probs

log = logging.getLogger("dflash.fastpath")


@dataclass
class DeviceTree:
    """``n`` drafted nodes plus the root (row 0), ordered by depth."""

    tokens: torch.Tensor  # [n+1] long, node tokens; row 0 (the root) holds 0, the caller supplies the pending token
    depths: torch.Tensor  # [n+1] long, 0 for the root
    parents: torch.Tensor  # [n+1] long, parent row (the root is its own parent)
    valid: torch.Tensor  # [n+1] bool, False for padding candidates and nodes whose parent was not selected
    ancestors: torch.Tensor  # [n+1, n+1] bool, [i, j] = j is i or one of its ancestors


class TreeBuilder:
    """Grows trees of `budget` nodes over `depth` drafted positions for a vocabulary of `vocab` tokens.

    Index buffers are made here, before any graph capture: at depth d+1 the extension of depth d's i-th best kept
    prefix (sorted descending) by the r-th best token has (i+1)(r+1) - 1 extensions at least as good, so only pairs
    with (i+1)(r+1) <= budget can be among the best `budget` (about budget x ln(budget) pairs instead of
    budget x K)."""

    def __init__(
        self, budget: int, depth: int, vocab: int, device: torch.device | str, *, kernel: bool | None = None
    ) -> None:
        """`kernel`: grow and walk trees with Triton programs (`dflash.kernels.triton_topk` for the drafter's
        top-k, `dflash.kernels.triton_tree` for the rest; None: when usable)."""
        from dflash.kernels.triton_topk import TopKScratch
        from dflash.kernels.triton_tree import GrowScratch, tree_kernel_usable

        device = torch.device(device)
        self.budget, self.depth, self.k = budget, depth, min(budget, vocab)
        self.kernel = tree_kernel_usable(device) if kernel is None else kernel
        pairs = [(i, r) for i in range(budget) for r in range(self.k) if (i + 1) * (r + 1) <= budget]
        self.pairs = len(pairs)
        padded = 1 << max(0, len(pairs) - 1).bit_length() if self.kernel else len(pairs)
        self.pair_parent = torch.zeros(padded, dtype=torch.long, device=device)  # [pairs]
        self.pair_rank = torch.zeros(padded, dtype=torch.long, device=device)  # [pairs]
        self.pair_parent[: len(pairs)] = torch.tensor([i for i, _ in pairs], dtype=torch.long)
        self.pair_rank[: len(pairs)] = torch.tensor([r for _, r in pairs], dtype=torch.long)
        self.pair_real = torch.arange(padded, device=device) < len(pairs)  # [pairs]
        self.first_rank = torch.arange(budget, device=device).clamp(max=self.k - 1)[None]  # [1, n]
        if self.kernel:
            self.pair_parent32 = self.pair_parent.to(torch.int32)
            self.pair_rank32 = self.pair_rank.to(torch.int32)
            self.top_lp = torch.zeros((depth, self.k), dtype=torch.float32, device=device)  # [depth, k]
            self.top_ids = torch.zeros((depth, self.k), dtype=torch.long, device=device)  # [depth, k]
            self.topk_scratch = TopKScratch(depth, vocab, self.k, device)
            self.grow_scratch = GrowScratch(depth, budget, padded, device)
            if not self._kernel_agrees(vocab, device):
                self.kernel = False

    def _kernel_agrees(self, vocab: int, device: torch.device) -> bool:
        """Grow and walk a tree once with the Triton programs and once with torch ops (random logits: no ties,
        so identical rows); a compile failure or a mismatch keeps the torch path, with a warning."""
        generator = torch.Generator().manual_seed(0)
        logits = torch.randn((self.depth, vocab), generator=generator).to(device)
        follow = torch.rand(self.budget + 1, generator=generator) < 0.8
        try:
            tree = self.grow(logits)  # target choices that follow the tree for a while, then leave it
            choices = torch.where(follow.to(device), tree.tokens.roll(-1), 0)
            fast = (*_tree_fields(tree), *self.walk(tree, choices))
        except Exception as exc:  # a Triton build these programs do not compile on
            log.warning("tree kernels unavailable (%s); building trees with torch ops", exc)
            return False
        self.kernel = False
        reference_tree = self.grow(logits)
        reference = (*_tree_fields(reference_tree), *self.walk(reference_tree, choices))
        self.kernel = True
        same = all(torch.equal(a, b) for a, b in zip(fast, reference, strict=True))
        if not same:
            log.warning("tree kernels disagree with the torch ops; building trees with torch ops")
        return same

    def grow(self, draft_logits: torch.Tensor) -> DeviceTree:
        """draft_logits: [depth, vocab] (row d-1 = block position d) -> the best `budget` prefixes."""
        depth, n, k, device = self.depth, self.budget, self.k, draft_logits.device
        if self.kernel:
            from dflash.kernels.triton_topk import draft_topk
            from dflash.kernels.triton_tree import tree_grow

            draft_topk(draft_logits[:depth], self.topk_scratch, self.top_lp, self.top_ids)
            return DeviceTree(*tree_grow(
                self.top_lp, self.top_ids, self.pair_parent32, self.pair_rank32, self.pairs, self.grow_scratch
            ))
        top_lp, top_ids = topk_log_probs(draft_logits[:depth], k)  # [depth, k] each, descending
        scores = torch.full((depth, n), float("-inf"), device=device)  # kept prefixes per depth, descending
        scores[0, :k] = top_lp[0]
        parent_index = torch.zeros((depth, n), dtype=torch.long, device=device)  # into the previous depth's kept
        rank = torch.zeros((depth, n), dtype=torch.long, device=device)  # candidate rank at this depth
        rank[0] = self.first_rank[0]
        for d in range(1, depth):
            extensions = torch.where(
                self.pair_real, scores[d - 1][self.pair_parent] + top_lp[d][self.pair_rank], float("-inf")
            )  # [pairs]
            best, order_d = extensions.sort(descending=True, stable=True)
            scores[d] = best[:n]
            parent_index[d] = self.pair_parent[order_d[:n]]
            rank[d] = self.pair_rank[order_d[:n]]
        return assemble_tree(scores, parent_index, rank, top_ids)

    def walk(
        self, tree: DeviceTree, choices: torch.Tensor,
        round_outputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """`walk_tree` over this builder's depth, as one Triton program when the builder uses kernels.
        `round_outputs` (out [depth+2], pending [1], new_rows [1], long) also receive a resident round's results:
        out = [accepted, committed tokens...], pending = the bonus token, new_rows = accepted + 1."""
        if self.kernel:
            from dflash.kernels.triton_tree import tree_walk

            return tree_walk(
                tree.tokens, tree.parents, tree.valid, tree.depths, tree.ancestors, choices, self.depth, round_outputs
            )
        path, length, bonus, committed = walk_tree(tree, choices, self.depth)
        if round_outputs is not None:
            out, pending, new_rows = round_outputs
            out[:1].copy_(length - 1)
            out[1:].copy_(committed)
            pending.copy_(bonus)
            new_rows.copy_(length)
        return path, length, bonus, committed

    def write_inputs(
        self, tree: DeviceTree, pending: torch.Tensor, length: torch.Tensor, input_ids: torch.Tensor,
        positions: torch.Tensor, tree_mask: torch.Tensor,
    ) -> None:
        """The tree as its verification's inputs: input_ids[:n+1] = [pending, node tokens], positions[:n+1] =
        length + depths (input_ids, positions: [rows] long, rows >= n+1; pending, length: [1] long), tree_mask
        [rows, rows] bool = the ancestor relation, padding rows seeing only themselves (one program with
        kernels)."""
        if self.kernel and tree_mask.is_contiguous():
            from dflash.kernels.triton_tree import tree_inputs

            tree_inputs(tree.tokens, tree.depths, tree.ancestors, pending, length, input_ids, positions, tree_mask)
            return
        nodes, rows = tree.tokens.shape[0], tree_mask.shape[0]
        input_ids[:1].copy_(pending)
        input_ids[1:nodes].copy_(tree.tokens[1:])
        positions[:nodes].copy_(length + tree.depths)
        tree_mask.copy_(torch.eye(rows, dtype=torch.bool, device=tree_mask.device))
        tree_mask[:nodes, :nodes].copy_(tree.ancestors)


def _tree_fields(tree: DeviceTree) -> tuple[torch.Tensor, ...]:
    return tree.tokens, tree.depths, tree.parents, tree.valid, tree.ancestors


def assemble_tree(
    scores: torch.Tensor, parent_index: torch.Tensor, rank: torch.Tensor, top_ids: torch.Tensor
) -> DeviceTree:
    """The best n of every depth's kept prefixes as tree rows. scores, parent_index, rank: [depth, n] (kept
    prefixes per depth: score, index of the parent among the previous depth's kept, candidate rank); top_ids:
    [depth, k] candidate tokens."""
    depth, n = scores.shape
    device = scores.device
    flat_scores = scores.reshape(-1)  # [depth * n], flat index = (d-1) * n + j
    chosen = flat_scores.sort(descending=True).indices[:n].sort().values  # [n], depth-major: parents first
    level_offsets = (torch.arange(depth, device=device) - 1)[:, None] * n  # [depth, 1]
    flat_parent = torch.where(level_offsets < 0, -1, level_offsets + parent_index).reshape(-1)  # [depth * n]
    row_of = torch.full((depth * n,), -1, dtype=torch.long, device=device)
    row_of[chosen] = torch.arange(1, n + 1, device=device)
    parent_flat = flat_parent[chosen]  # [n]
    parent_row = torch.where(parent_flat < 0, 0, row_of[parent_flat.clamp(min=0)])  # [n], -1: not selected
    valid = torch.isfinite(flat_scores[chosen]) & (parent_row >= 0)  # [n]
    zero = torch.zeros(1, dtype=torch.long, device=device)
    parents = torch.cat((zero, parent_row.clamp(min=0)))  # [n+1]
    tokens = torch.cat((zero, top_ids.gather(1, rank).reshape(-1)[chosen]))  # [n+1]
    depths = torch.cat((zero, torch.div(chosen, n, rounding_mode="floor") + 1))  # [n+1]
    valid = torch.cat((torch.ones(1, dtype=torch.bool, device=device), valid))  # [n+1]
    # ancestor-or-self closure of the parent relation by repeated squaring: paths up to `depth` long
    reach = torch.eye(n + 1, device=device)
    reach.scatter_(1, parents[:, None], 1.0)
    hops = 1
    while hops < depth:
        reach = (reach @ reach).clamp_(max=1.0)
        hops *= 2
    return DeviceTree(tokens, depths, parents, valid, reach > 0)



def walk_tree(
    tree: DeviceTree, choices: torch.Tensor, depth: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """choices: [n+1] long, the target's choice after each row -> (path [depth+1] rows from the root (entries past
    the path's length are row 0), length [1] (accepted nodes + 1), bonus [1], committed [depth+1] tokens: the
    accepted nodes' tokens then the bonus, entries past `length` unspecified)."""
    device = choices.device
    rows = tree.tokens.shape[0]
    is_root = torch.arange(rows, device=device) == 0
    match = ((tree.tokens == choices.gather(0, tree.parents)) & tree.valid) | is_root  # [n+1]
    accepted = ~(tree.ancestors & ~match[None, :]).any(dim=-1)  # [n+1]
    length = accepted.sum().view(1)  # [1], >= 1 (the root)
    scratch = torch.zeros(depth + 2, dtype=torch.long, device=device)  # slot depth+1 collects the rejected rows
    slot = torch.where(accepted, tree.depths, depth + 1)
    path = scratch.scatter(0, slot, torch.arange(rows, device=device))[: depth + 1]  # [depth+1]
    bonus = choices.gather(0, path.gather(0, length - 1))  # [1]
    steps = torch.arange(depth + 1, device=device)
    next_rows = path.gather(0, (steps + 1).clamp(max=depth))
    committed = torch.where(steps < length - 1, tree.tokens.gather(0, next_rows), bonus)  # [depth+1]
    return path, length, bonus, committed
