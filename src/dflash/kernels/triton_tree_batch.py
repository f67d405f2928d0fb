"""DDTree's trees for a batch of requests as Triton programs: every tree grown in one launch, every tree walked in one
launch (one program per tree each).

The batched step (`dflash.batch.device_trees`) builds each request's tree on the device from its drafter block. In
torch ops (`dflash.fastpath.batched_trees`) that is about ten kernels per depth plus the assembly, the walk and its
outputs: over a hundred tiny launches a step, more than the verification's own kernels cost. These programs do the
same work per tree as `dflash.kernels.triton_tree` does for one, with the rank of every node added (its place by
score among the tree's nodes, which tells what a smaller budget's tree would have committed) and the walk writing
the round's outputs directly.

`tree_grow_batch` keeps, per tree and depth, the `n` best extensions of the previous depth's kept prefixes, ranked
by counting better candidates (score, then pair index), and a running list of the `n` best scores over all depths;
the selection follows from the n-th best score and the tie rule (shallower depths first, then better ranks), rows
are depth-major, ancestors come from squaring (I + parent one-hot). Per-tree scratch lives in global memory
(`BatchGrowScratch`), made once before graph capture.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import torch

from dflash.kernels.triton_decode import next_power_of_two


@cache
def _kernels() -> tuple[Any, Any]:
    import triton
    import triton.language as tl

    @triton.jit
    def grow_kernel(  # type: ignore[no-untyped-def]
        top_lp_ptr, top_ids_ptr, pair_parent_ptr, pair_rank_ptr, level_scores_ptr, level_pairs_ptr,
        candidates_ptr, best_ptr, node_scores_ptr, tokens_ptr, depths_ptr, parents_ptr, valid_ptr, ancestors_ptr,
        ranks_ptr, depth, pairs, K,
        N: tl.constexpr, NP: tl.constexpr, P: tl.constexpr, D: tl.constexpr, R: tl.constexpr,
        CHUNK: tl.constexpr, MERGE_CHUNK: tl.constexpr,
    ):
        tree = tl.program_id(0).to(tl.int64)
        top_lp_ptr += tree * depth * K
        top_ids_ptr += tree * depth * K
        level_scores_ptr += tree * depth * N
        level_pairs_ptr += tree * depth * N
        candidates_ptr += tree * P
        best_ptr += tree * N
        node_scores_ptr += tree * R
        tokens_ptr += tree * (N + 1)
        depths_ptr += tree * (N + 1)
        parents_ptr += tree * (N + 1)
        valid_ptr += tree * (N + 1)
        ranks_ptr += tree * (N + 1)
        ancestors_ptr += tree * (N + 1) * (N + 1)
        kept = tl.arange(0, NP)  # slots N.. are padding
        real_slot = kept < N
        pair = tl.arange(0, P)
        pair_parent = tl.load(pair_parent_ptr + pair)
        pair_rank = tl.load(pair_rank_ptr + pair)
        real = pair < pairs
        # depth 1: the best first tokens, which also start the list of the n best kept prefixes of all depths
        first = tl.load(top_lp_ptr + kept, mask=kept < K, other=-float("inf"))  # K <= N
        tl.store(level_scores_ptr + kept, first, mask=real_slot)
        tl.store(level_pairs_ptr + kept, kept, mask=real_slot)
        tl.store(best_ptr + kept, first, mask=real_slot)
        merged = tl.arange(0, 2 * NP)  # merge candidates: the best list, then the new depth's kept list
        from_best = merged < NP
        merged_slot = tl.where(from_best, merged, merged - NP)
        tl.debug_barrier()
        # comparisons as [rows, CHUNK] tiles whose columns are read back from the scratch: every vector keeps one
        # register layout (no cross-thread shuffles between the reductions)
        for d in range(1, depth):
            score = tl.load(level_scores_ptr + (d - 1) * N + pair_parent) + tl.load(
                top_lp_ptr + d * K + pair_rank, mask=real, other=-float("inf"))
            score = tl.where(real, score, -float("inf"))  # [P]
            tl.store(candidates_ptr + pair, score)
            tl.debug_barrier()
            rank = tl.zeros([P], dtype=tl.int32)  # better candidates: a higher score, then a lower pair index
            for start in tl.static_range(0, P, CHUNK):
                other_index = start + tl.arange(0, CHUNK)
                other = tl.load(candidates_ptr + other_index)
                better = (other[None, :] > score[:, None]) | (
                    (other[None, :] == score[:, None]) & (other_index[None, :] < pair[:, None])
                )
                rank += tl.sum(better.to(tl.int32), axis=1)
            kept_here = rank < N
            tl.store(level_scores_ptr + d * N + rank, score, mask=kept_here)
            tl.store(level_pairs_ptr + d * N + rank, pair, mask=kept_here)
            tl.debug_barrier()
            level_base = level_scores_ptr + d * N
            value = tl.load(tl.where(from_best, best_ptr + merged_slot, level_base + merged_slot),
                            mask=merged_slot < N, other=-float("inf"))
            merged_rank = tl.zeros([2 * NP], dtype=tl.int32)
            for start in tl.static_range(0, 2 * NP, MERGE_CHUNK):
                other_index = start + tl.arange(0, MERGE_CHUNK)
                other_slot = tl.where(other_index < NP, other_index, other_index - NP)
                other = tl.load(tl.where(other_index < NP, best_ptr + other_slot, level_base + other_slot),
                                mask=other_slot < N, other=-float("inf"))
                better = (other[None, :] > value[:, None]) | (
                    (other[None, :] == value[:, None]) & (other_index[None, :] < merged[:, None])
                )
                merged_rank += tl.sum(better.to(tl.int32), axis=1)
            tl.debug_barrier()
            tl.store(best_ptr + merged_rank, value, mask=merged_rank < N)
            tl.debug_barrier()
        threshold = tl.load(best_ptr + N - 1)
        level = tl.arange(0, D)
        inside = (level[:, None] < depth) & real_slot[None, :]  # [D, NP]
        scores = tl.load(level_scores_ptr + level[:, None] * N + kept[None, :], mask=inside, other=-float("inf"))
        level_pair = tl.load(level_pairs_ptr + level[:, None] * N + kept[None, :], mask=inside, other=0)
        above = tl.sum((inside & (scores > threshold)).to(tl.int32), axis=1)  # [D]
        ties = tl.sum((inside & (scores == threshold)).to(tl.int32), axis=1)  # [D]
        tie_quota = N - tl.sum(above, axis=0)
        ties_before = tl.cumsum(ties, axis=0) - ties
        count = above + tl.minimum(ties, tl.maximum(tie_quota - ties_before, 0))  # [D] selected per depth
        offset = tl.cumsum(count, axis=0) - count  # [D] rows before the depth's
        is_previous = level[None, :] == level[:, None] - 1  # [D, D]
        previous_offset = tl.sum(tl.where(is_previous, offset[None, :], 0), axis=1)
        previous_count = tl.sum(tl.where(is_previous, count[None, :], 0), axis=1)
        chosen = kept[None, :] < count[:, None]  # [D, NP]
        row = offset[:, None] + kept[None, :] + 1
        deeper = inside & (level[:, None] > 0)
        parent_kept = tl.load(pair_parent_ptr + level_pair, mask=deeper, other=0)
        token_rank = tl.where(
            level[:, None] > 0, tl.load(pair_rank_ptr + level_pair, mask=deeper, other=0),
            tl.minimum(kept[None, :], K - 1),
        )
        parent_row = tl.where(
            level[:, None] > 0,
            tl.where(parent_kept < previous_count[:, None], previous_offset[:, None] + parent_kept + 1, -1),
            0,
        )
        token = tl.load(top_ids_ptr + level[:, None] * K + token_rank, mask=inside, other=0)
        valid = (scores > -float("inf")) & (parent_row >= 0)
        tl.store(tokens_ptr + row, token, mask=chosen)
        tl.store(depths_ptr + row, (level[:, None] + 1 + kept[None, :] * 0).to(tl.int64), mask=chosen)
        tl.store(parents_ptr + row, tl.maximum(parent_row, 0).to(tl.int64), mask=chosen)
        tl.store(valid_ptr + row, valid.to(tl.int8), mask=chosen)
        tl.store(node_scores_ptr + row, scores, mask=chosen)
        tl.store(tokens_ptr, 0)
        tl.store(depths_ptr, 0)
        tl.store(parents_ptr, 0)
        tl.store(valid_ptr, 1)
        tl.debug_barrier()
        rows = tl.arange(0, R)
        live = rows < N + 1
        node = live & (rows > 0)
        # a node's rank: the nodes scoring higher, or as high in an earlier row (rows are depth-major and, within a
        # depth, by rank: the order of a stable descending sort over depth-major candidates); the root: -1
        # the scores loaded twice, once per operand, so that each keeps its own register layout (no shuffle)
        mine = tl.load(node_scores_ptr + rows, mask=node, other=-float("inf"))
        theirs = tl.load(node_scores_ptr + rows, mask=node, other=-float("inf"))
        ahead = node[None, :] & node[:, None] & (
            (theirs[None, :] > mine[:, None]) | ((theirs[None, :] == mine[:, None]) & (rows[None, :] < rows[:, None]))
        )
        rank_of = tl.where(rows == 0, -1, tl.sum(ahead.to(tl.int32), axis=1))
        tl.store(ranks_ptr + rows, rank_of.to(tl.int64), mask=live)
        parent_of = tl.load(parents_ptr + rows, mask=live, other=0)  # [R]
        # ancestor-or-self closure: (I + A)^(2^k) clamped to 0/1 reaches 2^k hops up (A: the parent one-hot, the
        # root its own parent); exact in fp16 products with fp32 sums
        reach = ((rows[None, :] == rows[:, None]) | (rows[None, :] == parent_of[:, None])).to(tl.float16)
        hops = 1
        while hops < depth:
            reach = tl.minimum(tl.dot(reach, reach), 1.0).to(tl.float16)
            hops *= 2
        tl.store(
            ancestors_ptr + rows[:, None] * (N + 1) + rows[None, :], reach.to(tl.int8),
            mask=live[:, None] & live[None, :],
        )

    @triton.jit
    def walk_kernel(  # type: ignore[no-untyped-def]
        tokens_ptr, parents_ptr, valid_ptr, depths_ptr, ancestors_ptr, ranks_ptr, choices_ptr, choices_stride,
        smaller_ptr, path_ptr, length_ptr, out_ptr, out_stride, bonus_ptr, pending_ptr, new_rows_ptr, rows, depth,
        count, R: tl.constexpr, S: tl.constexpr, C: tl.constexpr, BONUS: tl.constexpr,
    ):
        tree = tl.program_id(0).to(tl.int64)
        tokens_ptr += tree * rows
        parents_ptr += tree * rows
        valid_ptr += tree * rows
        depths_ptr += tree * rows
        ranks_ptr += tree * rows
        ancestors_ptr += tree * rows * rows
        choices_ptr += tree * choices_stride
        path_ptr += tree * (depth + 1)
        out_ptr += tree * out_stride
        row = tl.arange(0, R)
        live = row < rows
        token = tl.load(tokens_ptr + row, mask=live, other=0)
        parent = tl.load(parents_ptr + row, mask=live, other=0)
        node_depth = tl.load(depths_ptr + row, mask=live, other=-1)
        valid = tl.load(valid_ptr + row, mask=live, other=0) != 0
        target_choice = tl.load(choices_ptr + parent, mask=live, other=-1)
        match = ((token == target_choice) & valid) | (row == 0)  # [R]
        ancestor = tl.load(
            ancestors_ptr + row[:, None] * rows + row[None, :], mask=live[:, None] & live[None, :], other=0
        ) != 0  # [R, R]
        blocked = tl.sum((ancestor & (match[None, :] == 0)).to(tl.int32), axis=1)
        accepted = live & (blocked == 0)  # siblings carry distinct tokens: one path from the root
        length = tl.sum(accepted.to(tl.int32), axis=0)  # accepted nodes + 1 (the root)
        step = tl.arange(0, S)
        on_path = accepted[None, :] & (node_depth[None, :] == step[:, None])  # [S, R]
        path = tl.sum(tl.where(on_path, row[None, :], 0), axis=1)  # [S], row 0 past the path
        next_on_path = accepted[None, :] & (node_depth[None, :] == step[:, None] + 1)
        next_token = tl.sum(tl.where(next_on_path, token[None, :], 0), axis=1)  # [S]
        last = tl.sum(tl.where(accepted & (node_depth == length - 1), row, 0), axis=0)
        bonus = tl.load(choices_ptr + last)
        steps = step < depth + 1
        tl.store(path_ptr + step, path.to(tl.int64), mask=steps)
        tl.store(length_ptr + tree, length.to(tl.int64))
        # the round's outputs: [accepted, committed tokens (the accepted nodes', then the bonus)...,
        # the walk's length within each smaller budget (the accepted nodes ranked below it, and the root)]
        tl.store(out_ptr, (length - 1).to(tl.int64))
        tl.store(out_ptr + 1 + step, tl.where(step < length - 1, next_token, bonus).to(tl.int64), mask=steps)
        budget_index = tl.arange(0, C)
        budgets = tl.load(smaller_ptr + budget_index, mask=budget_index < count, other=0)  # [C]
        rank = tl.load(ranks_ptr + row, mask=live & (row * 0 + count > 0), other=0)  # no rank read without budgets
        inside = accepted[None, :] & (rank[None, :] < budgets[:, None])  # [C, R]
        within = tl.sum(inside.to(tl.int32), axis=1)
        tl.store(out_ptr + depth + 2 + budget_index, within.to(tl.int64), mask=budget_index < count)
        if BONUS:  # a resident single-request round's: the bonus token, the next pending token, new context rows
            tl.store(bonus_ptr + tree, bonus)
            tl.store(pending_ptr + tree, bonus)
            tl.store(new_rows_ptr + tree, length.to(tl.int64))

    return grow_kernel, walk_kernel


class BatchGrowScratch:
    """`tree_grow_batch`'s per-tree scratch for `trees` trees of `budget` nodes over `depth` depths and `pairs` (a
    power of two) candidate pairs (made once, before graph capture)."""

    def __init__(self, trees: int, depth: int, budget: int, pairs: int, device: torch.device) -> None:
        self.trees, self.depth, self.budget, self.pairs = trees, depth, budget, pairs
        self.rows = max(16, next_power_of_two(budget + 1))
        self.scores = torch.empty((trees, depth, budget), dtype=torch.float32, device=device)
        self.kept_pairs = torch.empty((trees, depth, budget), dtype=torch.int32, device=device)
        self.candidates = torch.empty((trees, pairs), dtype=torch.float32, device=device)
        self.best = torch.empty((trees, budget), dtype=torch.float32, device=device)
        self.node_scores = torch.empty((trees, self.rows), dtype=torch.float32, device=device)


def tree_grow_batch(
    top_lp: torch.Tensor, top_ids: torch.Tensor, pair_parent: torch.Tensor, pair_rank: torch.Tensor, pairs: int,
    scratch: BatchGrowScratch, *, num_warps: int = 8,
) -> tuple[torch.Tensor, ...]:
    """top_lp, top_ids: [trees, depth, k] contiguous (descending log-probabilities, float32; token ids, long);
    pair_parent, pair_rank: [P] int32 (P = the scratch's pairs, a power of two), the first `pairs` real. Returns
    tokens, depths, parents [trees, n+1] long, valid [trees, n+1] bool, ancestors [trees, n+1, n+1] bool and ranks
    [trees, n+1] long, as `dflash.fastpath.batched_trees.BatchedTreeBuilder.grow`'s torch ops."""
    trees, depth, k = top_lp.shape
    n = scratch.budget
    assert top_lp.is_contiguous() and top_ids.is_contiguous() and trees <= scratch.trees and depth == scratch.depth
    device = top_lp.device
    tokens = torch.empty((trees, n + 1), dtype=torch.long, device=device)
    depths = torch.empty((trees, n + 1), dtype=torch.long, device=device)
    parents = torch.empty((trees, n + 1), dtype=torch.long, device=device)
    valid = torch.empty((trees, n + 1), dtype=torch.uint8, device=device)
    ancestors = torch.empty((trees, n + 1, n + 1), dtype=torch.uint8, device=device)
    ranks = torch.empty((trees, n + 1), dtype=torch.long, device=device)
    _kernels()[0][(trees,)](
        top_lp, top_ids, pair_parent, pair_rank, scratch.scores, scratch.kept_pairs, scratch.candidates,
        scratch.best, scratch.node_scores, tokens, depths, parents, valid, ancestors, ranks, depth, pairs, k,
        N=n, NP=next_power_of_two(n), P=scratch.pairs, D=next_power_of_two(depth), R=scratch.rows,
        CHUNK=min(32, scratch.pairs), MERGE_CHUNK=min(32, 2 * next_power_of_two(n)), num_warps=num_warps,
    )
    return tokens, depths, parents, valid.view(torch.bool), ancestors.view(torch.bool), ranks


def tree_walk_batch(
    tokens: torch.Tensor, parents: torch.Tensor, valid: torch.Tensor, depths: torch.Tensor, ancestors: torch.Tensor,
    ranks: torch.Tensor | None, choices: torch.Tensor, depth: int, smaller: torch.Tensor, out: torch.Tensor,
    single: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every tree's walk over the target's choices (choices: [trees, >= n+1] long, unit stride along the rows), one
    program per tree. Writes out [trees, depth + 2 + len(smaller)] long: [accepted nodes, the committed tokens
    (depth + 1 columns: the accepted nodes' tokens, then the bonus token), then for each budget of `smaller` (a
    long tensor) the tokens its tree (the best nodes by rank) would have committed]. Returns (path [trees, depth+1]
    rows from the root (row 0 past the path), length [trees] = accepted nodes + 1). `ranks` may be None where
    `smaller` is empty; `single` (bonus, pending, new_rows: [trees] long each) also receives each tree's bonus token
    (twice) and its length (a resident single-request round's outputs)."""
    trees, rows = tokens.shape
    assert choices.stride(1) == 1 and out.stride(1) == 1 and out.shape[1] == depth + 2 + smaller.shape[0]
    device = tokens.device
    path = torch.empty((trees, depth + 1), dtype=torch.long, device=device)
    length = torch.empty(trees, dtype=torch.long, device=device)
    budgets = smaller if smaller.numel() else length  # no budget (nor rank) is read when there is none
    assert ranks is not None or not smaller.numel()
    bonus, pending, new_rows = single if single is not None else (length, length, length)
    _kernels()[1][(trees,)](
        tokens, parents, valid.view(torch.uint8), depths, ancestors.view(torch.uint8),
        ranks if ranks is not None else tokens, choices, choices.stride(0), budgets, path, length, out, out.stride(0),
        bonus, pending, new_rows, rows, depth, smaller.shape[0],
        R=next_power_of_two(rows), S=next_power_of_two(depth + 1), C=max(2, next_power_of_two(smaller.shape[0])),
        BONUS=single is not None, num_warps=4,
    )
    return path, length
