"""DDTree's device tree of one request as Triton programs: growing it, walking it, laying out its verification.

`dflash.fastpath.device_tree.TreeBuilder` keeps, at every depth, the `n` best extensions of the previous depth's
kept prefixes, and the tree is the `n` best of all kept prefixes. In torch ops that is about ten tiny kernels per
depth plus a global sort; `tree_grow` runs it as one program, the batched step's (`dflash.kernels.triton_tree_batch`,
which describes it) over one tree. `tree_walk` is the acceptance walk over the target's choices and `tree_inputs`
the tree as its verification's rows, one program each.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import torch

from dflash.kernels.triton_decode import interpreting, next_power_of_two, triton_available


def tree_kernel_usable(device: torch.device) -> bool:
    return triton_available() and (device.type == "cuda" or interpreting())


@cache
def _kernels() -> Any:
    import triton
    import triton.language as tl

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

    return tree_inputs_kernel


class GrowScratch:
    """`tree_grow`'s scratch for `depth` depths of `budget` over `pairs` (a power of two) candidate pairs (made once,
    before capture): one tree's share of `dflash.kernels.triton_tree_batch`'s."""

    def __init__(self, depth: int, budget: int, pairs: int, device: torch.device) -> None:
        from dflash.kernels.triton_tree_batch import BatchGrowScratch

        self.batch = BatchGrowScratch(1, depth, budget, pairs, device)


def tree_grow(
    top_lp: torch.Tensor, top_ids: torch.Tensor, pair_parent: torch.Tensor, pair_rank: torch.Tensor, pairs: int,
    scratch: GrowScratch, *, num_warps: int = 8,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """top_lp, top_ids: [depth, k] (descending log-probabilities, float32; token ids, long); pair_parent,
    pair_rank: [P] int32 with P a power of two, the first `pairs` real. Returns tokens, depths, parents [n+1]
    long, valid [n+1] bool and ancestors [n+1, n+1] bool, as `dflash.fastpath.device_tree.assemble_tree`: the
    batched program (`tree_grow_batch`) over one tree."""
    from dflash.kernels.triton_tree_batch import tree_grow_batch

    tokens, depths, parents, valid, ancestors, _ = tree_grow_batch(
        top_lp[None], top_ids[None], pair_parent, pair_rank, pairs, scratch.batch, num_warps=num_warps
    )
    return tokens[0], depths[0], parents[0], valid[0], ancestors[0]


def tree_walk(
    tokens: torch.Tensor, parents: torch.Tensor, valid: torch.Tensor, depths: torch.Tensor,
    ancestors: torch.Tensor, choices: torch.Tensor, depth: int,
    round_outputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`dflash.fastpath.device_tree.walk_tree` in one program: (path [depth+1], length [1], bonus [1],
    committed [depth+1]). `round_outputs` (out [depth+2], pending [1], new_rows [1], long): also write a resident
    round's outputs, out = [length - 1, committed...], pending = bonus, new_rows = length."""
    from dflash.kernels.triton_tree_batch import tree_walk_batch

    device = tokens.device
    out = round_outputs[0] if round_outputs is not None else torch.empty(depth + 2, dtype=torch.long, device=device)
    scratch = torch.empty(3, dtype=torch.long, device=device)
    bonus = scratch[:1]
    pending, new_rows = round_outputs[1:] if round_outputs is not None else (scratch[1:2], scratch[2:])
    path, length = tree_walk_batch(
        tokens[None], parents[None], valid[None], depths[None], ancestors[None], None, choices[None], depth,
        scratch[:0], out[None], (bonus, pending, new_rows),
    )
    return path[0], length, bonus, out[1:]


def tree_inputs(
    tokens: torch.Tensor, depths: torch.Tensor, ancestors: torch.Tensor, pending: torch.Tensor, length: torch.Tensor,
    input_ids: torch.Tensor, positions: torch.Tensor, tree_mask: torch.Tensor,
) -> None:
    """A grown tree as the inputs of its verification, in one program: tokens, depths [n+1] long and ancestors
    [n+1, n+1] bool (`tree_grow`'s); pending, length: [1] long -> input_ids[:n+1] = [pending, tokens[1:]],
    positions[:n+1] = length + depths (input_ids, positions: [rows] long, rows >= n+1), tree_mask [rows, rows]
    bool (contiguous) = the ancestors, padding rows seeing only themselves."""
    nodes, rows = tokens.shape[0], tree_mask.shape[0]
    _kernels()[(1,)](
        tokens, depths, ancestors.view(torch.uint8), pending, length, input_ids, positions,
        tree_mask.view(torch.uint8), nodes, rows, R=next_power_of_two(max(rows, nodes)), num_warps=4,
    )
