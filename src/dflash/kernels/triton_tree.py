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

    return tree_levels_kernel


def tree_levels(
    candidate_lp: torch.Tensor, pair_parent: torch.Tensor, scores: torch.Tensor, order: torch.Tensor,
    scratch: torch.Tensor,
) -> None:
    """candidate_lp: [depth, P] float32, the log-probability of each candidate pair's token at each depth (-inf for
    padding pairs, P a power of two); pair_parent: [P] int32, the pair's parent among the previous depth's kept;
    scores: [depth, n] float32 with row 0 filled (the first depth's kept); order: [depth, n] int32; scratch: [P]
    float32. Fills rows 1.. of `scores` (descending) and `order` (the kept pair per rank)."""
    depth, pairs = candidate_lp.shape
    _kernel()[(1,)](
        candidate_lp, pair_parent, scores, order, scratch, depth,
        N=scores.shape[1], P=pairs, CHUNK=min(pairs, 32), num_warps=4,
    )
