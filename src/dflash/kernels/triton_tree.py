"""One Triton program for the level-by-level part of DDTree's device tree building.

`dflash.fastpath.device_tree.TreeBuilder` keeps, at every depth, the `n` best extensions of the previous depth's
kept prefixes. In torch ops that is about ten tiny kernels per depth (gathers, a sort, slices); here one program
walks the depths in a loop: per depth it scores the candidate pairs (gather + add), ranks each candidate by
counting the better ones (score, then candidate index on ties) and scatters the best `n` to their rank. Same
result as a descending sort that breaks ties by index.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import torch

from dflash.kernels.triton_decode import interpreting, triton_available


def tree_kernel_usable(device: torch.device) -> bool:
    return triton_available() and (device.type == "cuda" or interpreting())


@cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def tree_levels_kernel(  # type: ignore[no-untyped-def]
        candidate_lp_ptr, pair_parent_ptr, scores_ptr, order_ptr, scratch_ptr, depth,
        N: tl.constexpr, P: tl.constexpr, CHUNK: tl.constexpr,
    ):
        pairs = tl.arange(0, P)
        parent = tl.load(pair_parent_ptr + pairs)
        for d in range(1, depth):
            score = tl.load(scores_ptr + (d - 1) * N + parent) + tl.load(candidate_lp_ptr + d * P + pairs)
            tl.store(scratch_ptr + pairs, score)
            tl.debug_barrier()
            rank = tl.zeros([P], dtype=tl.int32)
            for start in tl.static_range(0, P, CHUNK):
                other_index = start + tl.arange(0, CHUNK)
                other = tl.load(scratch_ptr + other_index)
                better = (other[None, :] > score[:, None]) | (
                    (other[None, :] == score[:, None]) & (other_index[None, :] < pairs[:, None])
                )
                rank += tl.sum(better.to(tl.int32), axis=1)
            kept = rank < N
            tl.store(scores_ptr + d * N + rank, score, mask=kept)
            tl.store(order_ptr + d * N + rank, pairs, mask=kept)
            tl.debug_barrier()

    @triton.jit
    def tree_assemble_kernel(  # type: ignore[no-untyped-def]
        scores_ptr, order_ptr, pair_parent_ptr, pair_rank_ptr, top_ids_ptr, row_of_ptr,
        tokens_ptr, depths_ptr, parents_ptr, valid_ptr, ancestors_ptr, depth, K,
        N: tl.constexpr, M: tl.constexpr, R: tl.constexpr, CHUNK: tl.constexpr,
    ):
        flat = tl.arange(0, M)  # kept prefix d * N + j (depth d + 1, j-th best there)
        total = depth * N
        live = flat < total
        score = tl.load(scores_ptr + flat, mask=live, other=-float("inf"))
        rank = tl.zeros([M], dtype=tl.int32)
        for start in tl.static_range(0, M, CHUNK):
            other_index = start + tl.arange(0, CHUNK)
            other = tl.load(scores_ptr + other_index, mask=other_index < total, other=-float("inf"))
            better = (other[None, :] > score[:, None]) | (
                (other[None, :] == score[:, None]) & (other_index[None, :] < flat[:, None])
            )
            rank += tl.sum(better.to(tl.int32), axis=1)
        chosen = (rank < N) & live
        row = tl.cumsum(chosen.to(tl.int32), axis=0)  # rows 1..N in depth-major order
        tl.store(row_of_ptr + flat, tl.where(chosen, row, -1))
        tl.debug_barrier()
        level = flat // N
        deeper = live & (level > 0)
        pair = tl.load(order_ptr + flat, mask=deeper, other=0)
        parent_kept = tl.load(pair_parent_ptr + pair, mask=deeper, other=0)
        token_rank = tl.where(level > 0, tl.load(pair_rank_ptr + pair, mask=deeper, other=0),
                              tl.minimum(flat % N, K - 1))
        parent_row = tl.where(level > 0, tl.load(row_of_ptr + (level - 1) * N + parent_kept, mask=deeper, other=0), 0)
        token = tl.load(top_ids_ptr + level * K + token_rank, mask=live, other=0)
        valid = (score > -float("inf")) & (parent_row >= 0)
        tl.store(tokens_ptr + row, token, mask=chosen)
        tl.store(depths_ptr + row, level + 1, mask=chosen)
        tl.store(parents_ptr + row, tl.maximum(parent_row, 0), mask=chosen)
        tl.store(valid_ptr + row, valid.to(tl.int8), mask=chosen)
        root = flat == 0
        tl.store(tokens_ptr + flat, tl.zeros([M], dtype=tl.int64), mask=root)
        tl.store(depths_ptr + flat, tl.zeros([M], dtype=tl.int64), mask=root)
        tl.store(parents_ptr + flat, tl.zeros([M], dtype=tl.int64), mask=root)
        tl.store(valid_ptr + flat, tl.full([M], 1, dtype=tl.int8), mask=root)
        rows = tl.arange(0, R)
        inside = rows < N + 1
        tl.store(
            ancestors_ptr + rows[:, None] * (N + 1) + rows[None, :], tl.zeros([R, R], dtype=tl.int8),
            mask=inside[:, None] & inside[None, :],
        )
        tl.debug_barrier()
        node = rows.to(tl.int64)
        for _ in range(0, depth + 1):  # the node itself, then its ancestors up to the root (its own parent)
            tl.store(ancestors_ptr + rows * (N + 1) + node, tl.full([R], 1, dtype=tl.int8), mask=inside)
            node = tl.load(parents_ptr + node, mask=inside, other=0)

    return tree_levels_kernel, tree_assemble_kernel


def tree_levels(
    candidate_lp: torch.Tensor, pair_parent: torch.Tensor, scores: torch.Tensor, order: torch.Tensor,
    scratch: torch.Tensor,
) -> None:
    """candidate_lp: [depth, P] float32, the log-probability of each candidate pair's token at each depth (-inf for
    padding pairs, P a power of two); pair_parent: [P] int32, the pair's parent among the previous depth's kept;
    scores: [depth, n] float32 with row 0 filled (the first depth's kept); order: [depth, n] int32; scratch: [P]
    float32. Fills rows 1.. of `scores` (descending) and `order` (the kept pair per rank)."""
    depth, pairs = candidate_lp.shape
    _kernel()[0][(1,)](
        candidate_lp, pair_parent, scores, order, scratch, depth,
        N=scores.shape[1], P=pairs, CHUNK=min(pairs, 32), num_warps=4,
    )


def tree_assemble(
    scores: torch.Tensor, order: torch.Tensor, pair_parent: torch.Tensor, pair_rank: torch.Tensor,
    top_ids: torch.Tensor, row_of: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The best n of every depth's kept prefixes as tree rows (depth-major), from `tree_levels`' output.

    scores, order: [depth, n]; pair_parent, pair_rank: [P] int32; top_ids: [depth, k] long; row_of: [M] int32
    scratch, M a power of two >= depth * n. Returns tokens, depths, parents [n+1] long, valid [n+1] bool and
    ancestors [n+1, n+1] bool, as `dflash.fastpath.device_tree.assemble_tree`."""
    depth, n = scores.shape
    device = scores.device
    tokens = torch.empty(n + 1, dtype=torch.long, device=device)
    depths = torch.empty(n + 1, dtype=torch.long, device=device)
    parents = torch.empty(n + 1, dtype=torch.long, device=device)
    valid = torch.empty(n + 1, dtype=torch.uint8, device=device)
    ancestors = torch.empty((n + 1, n + 1), dtype=torch.uint8, device=device)
    _kernel()[1][(1,)](
        scores, order, pair_parent, pair_rank, top_ids, row_of, tokens, depths, parents, valid, ancestors,
        depth, top_ids.shape[1], N=n, M=row_of.shape[0], R=1 << n.bit_length(), CHUNK=32, num_warps=4,
    )
    return tokens, depths, parents, valid.view(torch.bool), ancestors.view(torch.bool)
