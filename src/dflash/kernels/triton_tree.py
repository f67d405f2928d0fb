"""DDTree's device tree as Triton programs: growing the tree (one program) and walking it (one program).

`dflash.fastpath.device_tree.TreeBuilder` keeps, at every depth, the `n` best extensions of the previous depth's
kept prefixes, and the tree is the `n` best of all kept prefixes. In torch ops that is about ten tiny kernels per
depth plus a global sort; `tree_grow` does it in one program:

* per depth, every candidate pair (kept parent, token rank) is scored (the parent's score plus the token's
  log-probability) and ranked by counting the better candidates (score, then pair index on ties); the `n` best
  become the depth's kept list, sorted. Comparisons run as [rows, 32] tiles whose columns are read back from a
  small global scratch, so that every vector keeps one register layout (layout shuffles between reductions made a
  register-only version four times slower on the GPU);
* a running list of the `n` best scores over all depths so far is merged with each depth's list the same way;
  its last entry is the selection threshold;
* each depth's selected prefixes are a prefix of its sorted list (entries equal to the threshold go to shallower
  depths first, then to better ranks, as a descending sort over depth-major indices would), so rows follow from
  per-depth counts (rows are depth-major: parents precede children), parent rows from the previous depth's
  offset, and the ancestor matrix from squaring (I + parent one-hot) in fp16 matrix products.

`tree_walk` is the acceptance walk over the target's choices, in one program.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import torch

from dflash.kernels.triton_decode import interpreting, next_power_of_two, triton_available


def tree_kernel_usable(device: torch.device) -> bool:
    return triton_available() and (device.type == "cuda" or interpreting())


@cache
def _kernels() -> tuple[Any, Any, Any]:
    import triton
    import triton.language as tl

    @triton.jit
    def tree_grow_kernel(  # type: ignore[no-untyped-def]
        top_lp_ptr, top_ids_ptr, pair_parent_ptr, pair_rank_ptr, level_scores_ptr, level_pairs_ptr,
        candidates_ptr, best_ptr, tokens_ptr, depths_ptr, parents_ptr, valid_ptr, ancestors_ptr, depth, pairs, K,
        N: tl.constexpr, NP: tl.constexpr, P: tl.constexpr, D: tl.constexpr, R: tl.constexpr,
        CHUNK: tl.constexpr, MERGE_CHUNK: tl.constexpr, STAGES: tl.constexpr,
    ):
        kept = tl.arange(0, NP)  # slots N.. are padding
        real_slot = kept < N
        pair = tl.arange(0, P)
        pair_parent = tl.load(pair_parent_ptr + pair)
        pair_rank = tl.load(pair_rank_ptr + pair)
        real = pair < pairs
        # depth 1: the best first tokens; they also start the list of the n best kept prefixes of all depths
        first = tl.load(top_lp_ptr + kept, mask=kept < K, other=-float("inf"))  # K <= N
        tl.store(level_scores_ptr + kept, first, mask=real_slot)
        tl.store(level_pairs_ptr + kept, kept, mask=real_slot)
        tl.store(best_ptr + kept, first, mask=real_slot)
        merged = tl.arange(0, 2 * NP)  # merge candidates: the best list, then the new depth's kept list
        from_best = merged < NP
        merged_slot = tl.where(from_best, merged, merged - NP)
        tl.debug_barrier()
        # every [rows, CHUNK] comparison reads its columns back from global scratch: the vectors keep one register
        # layout (no cross-thread shuffles), which is what keeps a depth at about a microsecond
        for d in range(1, depth):
            score = tl.load(level_scores_ptr + (d - 1) * N + pair_parent) + tl.load(
                top_lp_ptr + d * K + pair_rank, mask=real, other=-float("inf"))
            score = tl.where(real, score, -float("inf"))  # [P]
            tl.store(candidates_ptr + pair, score)
            tl.debug_barrier()
            rank = tl.zeros([P], dtype=tl.int32)  # better candidates: higher score, then lower pair index
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
            # merge the n best so far with this depth's n (values only: any strict order of equal values does)
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
        if STAGES < 2:  # profiling: the levels alone
            return
        # the threshold is the n-th best score; how many entries equal to it each depth keeps follows from the
        # tie rule (shallower depths first, then rank)
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
        chosen = kept[None, :] < count[:, None]  # [D, N]
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
        tl.store(tokens_ptr, 0)
        tl.store(depths_ptr, 0)
        tl.store(parents_ptr, 0)
        tl.store(valid_ptr, 1)
        tl.debug_barrier()
        rows = tl.arange(0, R)
        live = rows < N + 1
        if STAGES < 3:  # profiling: without the ancestor matrix
            return
        parent_of = tl.load(parents_ptr + rows, mask=live, other=0)  # [R]
        # ancestor-or-self closure: (I + A)^(2^k) clamped to 0/1 reaches 2^k hops up (A: the parent one-hot,
        # the root its own parent); exact in fp16 products with fp32 sums
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
    def tree_walk_kernel(  # type: ignore[no-untyped-def]
        tokens_ptr, parents_ptr, valid_ptr, depths_ptr, ancestors_ptr, choices_ptr,
        path_ptr, length_ptr, bonus_ptr, committed_ptr, out_ptr, pending_ptr, new_rows_ptr, rows, depth,
        R: tl.constexpr, S: tl.constexpr, ROUND: tl.constexpr,
    ):
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
        accepted = live & (blocked == 0)
        length = tl.sum(accepted.to(tl.int32), axis=0)  # accepted nodes + 1 (the root)
        step = tl.arange(0, S)
        on_path = accepted[None, :] & (node_depth[None, :] == step[:, None])  # [S, R]
        path = tl.sum(tl.where(on_path, row[None, :], 0), axis=1)  # [S], 0 past the path
        next_on_path = accepted[None, :] & (node_depth[None, :] == step[:, None] + 1)
        next_token = tl.sum(tl.where(next_on_path, token[None, :], 0), axis=1)  # [S]
        last = tl.sum(tl.where(accepted & (node_depth == length - 1), row, 0), axis=0)
        bonus = tl.load(choices_ptr + last)
        tl.store(path_ptr + step, path.to(tl.int64), mask=step < depth + 1)
        tl.store(committed_ptr + step, tl.where(step < length - 1, next_token, bonus), mask=step < depth + 1)
        tl.store(length_ptr, length.to(tl.int64))
        tl.store(bonus_ptr, bonus)
        if ROUND:  # the resident round's outputs: [accepted, committed...], the next pending token, new context rows
            tl.store(out_ptr, (length - 1).to(tl.int64))
            tl.store(out_ptr + 1 + step, tl.where(step < length - 1, next_token, bonus), mask=step < depth + 1)
            tl.store(pending_ptr, bonus)
            tl.store(new_rows_ptr, length.to(tl.int64))

    @triton.jit
    def tree_inputs_kernel(  # type: ignore[no-untyped-def]
        tokens_ptr, depths_ptr, ancestors_ptr, pending_ptr, length_ptr, ids_ptr, positions_ptr, mask_ptr,
        nodes, rows, R: tl.constexpr,
    ):
        row = tl.arange(0, R)
        node = row < nodes  # the root and the drafted nodes; rows past them pad the forward
        token = tl.load(tokens_ptr + row, mask=node, other=0)
        tl.store(ids_ptr + row, tl.where(row == 0, tl.load(pending_ptr), token), mask=node)
        tl.store(positions_ptr + row, tl.load(length_ptr) + tl.load(depths_ptr + row, mask=node, other=0), mask=node)
        both = node[:, None] & node[None, :]
        ancestor = tl.load(ancestors_ptr + row[:, None] * nodes + row[None, :], mask=both, other=0)
        visible = tl.where(both, ancestor != 0, row[:, None] == row[None, :])  # padding rows see only themselves
        tl.store(mask_ptr + row[:, None] * rows + row[None, :], visible.to(tl.uint8),
                 mask=(row[:, None] < rows) & (row[None, :] < rows))

    return tree_grow_kernel, tree_walk_kernel, tree_inputs_kernel


class GrowScratch:
    """`tree_grow`'s scratch for `depth` depths of `budget` over `pairs` (a power of two) candidate pairs: the
    per-depth kept lists, one depth's candidate scores, the running best list (made once, before capture)."""

    def __init__(self, depth: int, budget: int, pairs: int, device: torch.device) -> None:
        self.scores = torch.empty((depth, budget), dtype=torch.float32, device=device)
        self.pairs = torch.empty((depth, budget), dtype=torch.int32, device=device)
        self.candidates = torch.empty(pairs, dtype=torch.float32, device=device)
        self.best = torch.empty(budget, dtype=torch.float32, device=device)


def tree_grow(
    top_lp: torch.Tensor, top_ids: torch.Tensor, pair_parent: torch.Tensor, pair_rank: torch.Tensor, pairs: int,
    scratch: GrowScratch, *, stages: int = 3, num_warps: int = 8,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """top_lp, top_ids: [depth, k] (descending log-probabilities, float32; token ids, long); pair_parent,
    pair_rank: [P] int32 with P a power of two, the first `pairs` real. Returns tokens, depths, parents [n+1]
    long, valid [n+1] bool and ancestors [n+1, n+1] bool, as `dflash.fastpath.device_tree.assemble_tree`
    (`stages` 1: the levels only, 2: without the ancestors; for profiling)."""
    depth, n = scratch.scores.shape
    device = top_lp.device
    tokens = torch.empty(n + 1, dtype=torch.long, device=device)
    depths = torch.empty(n + 1, dtype=torch.long, device=device)
    parents = torch.empty(n + 1, dtype=torch.long, device=device)
    valid = torch.empty(n + 1, dtype=torch.uint8, device=device)
    ancestors = torch.empty((n + 1, n + 1), dtype=torch.uint8, device=device)
    _kernels()[0][(1,)](
        top_lp, top_ids, pair_parent, pair_rank, scratch.scores, scratch.pairs, scratch.candidates, scratch.best,
        tokens, depths, parents, valid, ancestors, depth, pairs, top_lp.shape[1],
        N=n, NP=next_power_of_two(n), P=pair_parent.shape[0], D=next_power_of_two(depth),
        R=max(16, next_power_of_two(n + 1)), CHUNK=min(32, pair_parent.shape[0]),
        MERGE_CHUNK=min(32, 2 * next_power_of_two(n)), STAGES=stages,
        num_warps=num_warps,
    )
    return tokens, depths, parents, valid.view(torch.bool), ancestors.view(torch.bool)


def tree_walk(
    tokens: torch.Tensor, parents: torch.Tensor, valid: torch.Tensor, depths: torch.Tensor,
    ancestors: torch.Tensor, choices: torch.Tensor, depth: int,
    round_outputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`dflash.fastpath.device_tree.walk_tree` in one program: (path [depth+1], length [1], bonus [1],
    committed [depth+1]). `round_outputs` (out [depth+2], pending [1], new_rows [1], long): also write a resident
    round's outputs, out = [length - 1, committed...], pending = bonus, new_rows = length."""
    rows = tokens.shape[0]
    device = tokens.device
    path = torch.empty(depth + 1, dtype=torch.long, device=device)
    committed = torch.empty(depth + 1, dtype=torch.long, device=device)
    length = torch.empty(1, dtype=torch.long, device=device)
    bonus = torch.empty(1, dtype=torch.long, device=device)
    out, pending, new_rows = round_outputs if round_outputs is not None else (length, bonus, length)
    _kernels()[1][(1,)](
        tokens, parents, valid.view(torch.uint8), depths, ancestors.view(torch.uint8), choices,
        path, length, bonus, committed, out, pending, new_rows, rows, depth,
        R=next_power_of_two(rows), S=next_power_of_two(depth + 1), ROUND=round_outputs is not None, num_warps=4,
    )
    return path, length, bonus, committed


def tree_inputs(
    tokens: torch.Tensor, depths: torch.Tensor, ancestors: torch.Tensor, pending: torch.Tensor, length: torch.Tensor,
    input_ids: torch.Tensor, positions: torch.Tensor, tree_mask: torch.Tensor,
) -> None:
    """A grown tree as the inputs of its verification, in one program: tokens, depths [n+1] long and ancestors
    [n+1, n+1] bool (`tree_grow`'s); pending, length: [1] long -> input_ids[:n+1] = [pending, tokens[1:]],
    positions[:n+1] = length + depths (input_ids, positions: [rows] long, rows >= n+1), tree_mask [rows, rows]
    bool (contiguous) = the ancestors, padding rows seeing only themselves."""
    nodes, rows = tokens.shape[0], tree_mask.shape[0]
    _kernels()[2][(1,)](
        tokens, depths, ancestors.view(torch.uint8), pending, length, input_ids, positions,
        tree_mask.view(torch.uint8), nodes, rows, R=next_power_of_two(max(rows, nodes)), num_warps=4,
    )
