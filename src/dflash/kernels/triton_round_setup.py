"""The per-forward index and mask work of the graphed forwards, one Triton program each (GPU fast path).

Before its first layer a graphed target forward derives, from the committed length (a device scalar) and the new
rows' positions and mask, the cache slots the rows are stored at, the positions those slots hold, the additive
attention mask over the bucket of slots attention reads, and the rows' rotary cos/sin; the drafter's round does
the same for its context rows and block. In torch ops that is about twenty tiny kernels per forward (aranges,
comparisons, a gather of the mask, fills, casts, index copies, cos/sin gathers), a few microseconds each at batch
one; here it is one launch:

* `target_setup`: slots ``length + r``; ``stored_positions[slot] = positions[r]``; the additive mask (0 where row
  ``r`` sees slot ``j``: every committed slot ``j < length`` and, among the new rows' slots, those its
  ``tree_mask`` row allows; ``-inf`` elsewhere; `dflash.fastpath.static_forward.block_visibility`); cos/sin rows
  gathered from the rotary table (`dflash.models.rope.Rotary.prepare_table`);
* `drafter_setup`: the drafter round's context positions ``start - new_rows + i`` and block positions
  ``start + i`` (i < B), their slots (a scratch context row, ``i >= new_rows``, stores nothing: slot -1), the
  context positions written to the cache's position row, one additive mask row (committed slots and the block
  visible), and cos/sin for the 2B rows (`dflash.fastpath.fused_drafter`).
"""

from __future__ import annotations

from functools import cache
from typing import Any

import torch

from dflash.kernels.triton_decode import next_power_of_two

COLUMNS = 256  # mask columns per program


@cache
def _kernels() -> tuple[Any, Any]:
    import triton
    import triton.language as tl

    @triton.jit
    def target_setup_kernel(  # type: ignore[no-untyped-def]
        length_ptr, positions_ptr, tree_mask_ptr, stored_positions_ptr, cos_table_ptr, sin_table_ptr,
        slots_ptr, additive_ptr, cos_ptr, sin_ptr, rows, bucket,
        ROWS: tl.constexpr, COLUMNS: tl.constexpr, HEAD_DIM: tl.constexpr,
    ):
        chunk = tl.program_id(0)
        length = tl.load(length_ptr)
        row = tl.arange(0, ROWS)
        live = row < rows
        column = chunk * COLUMNS + tl.arange(0, COLUMNS)
        relative = column - length  # [COLUMNS]: the new row stored at this slot, if 0 <= relative < rows
        in_block = (relative >= 0) & (relative < rows)
        allowed = tl.load(tree_mask_ptr + row[:, None] * rows + relative[None, :],
                          mask=live[:, None] & in_block[None, :], other=0)  # [ROWS, COLUMNS]
        visible = (relative[None, :] < 0) | (allowed != 0)
        tl.store(additive_ptr + row[:, None] * bucket + column[None, :],
                 tl.where(visible, 0.0, float("-inf")).to(additive_ptr.dtype.element_ty),
                 mask=live[:, None] & (column[None, :] < bucket))
        if chunk == 0:
            position = tl.load(positions_ptr + row, mask=live, other=0)  # [ROWS]
            slot = length + row
            tl.store(slots_ptr + row, slot, mask=live)
            tl.store(stored_positions_ptr + slot, position, mask=live)
            dims = tl.arange(0, HEAD_DIM)
            table_at = position[:, None] * HEAD_DIM + dims[None, :]
            out_at = row[:, None] * HEAD_DIM + dims[None, :]
            tl.store(cos_ptr + out_at, tl.load(cos_table_ptr + table_at, mask=live[:, None]), mask=live[:, None])
            tl.store(sin_ptr + out_at, tl.load(sin_table_ptr + table_at, mask=live[:, None]), mask=live[:, None])

    @triton.jit
    def drafter_setup_kernel(  # type: ignore[no-untyped-def]
        start_ptr, new_rows_ptr, stored_positions_ptr, cos_table_ptr, sin_table_ptr, slots_ptr, additive_ptr,
        cos_ptr, sin_ptr, bucket,
        BLOCK: tl.constexpr, ROWS: tl.constexpr, COLUMNS: tl.constexpr, HEAD_DIM: tl.constexpr,
    ):
        chunk = tl.program_id(0)
        start = tl.load(start_ptr)
        column = chunk * COLUMNS + tl.arange(0, COLUMNS)
        tl.store(additive_ptr + column,
                 tl.where(column < start + BLOCK, 0.0, float("-inf")).to(additive_ptr.dtype.element_ty),
                 mask=column < bucket)
        if chunk == 0:
            new_rows = tl.load(new_rows_ptr)
            row = tl.arange(0, ROWS)  # context rows 0..B-1, then block rows B..2B-1
            live = row < 2 * BLOCK
            context = row < BLOCK
            offset = tl.where(context, row, row - BLOCK)
            position = tl.where(context, start - new_rows + offset, start + offset)
            tl.store(slots_ptr + row, tl.where(context & (offset >= new_rows), -1, position), mask=live)
            tl.store(stored_positions_ptr + position, position, mask=context)
            dims = tl.arange(0, HEAD_DIM)
            table_at = position[:, None] * HEAD_DIM + dims[None, :]
            out_at = row[:, None] * HEAD_DIM + dims[None, :]
            tl.store(cos_ptr + out_at, tl.load(cos_table_ptr + table_at, mask=live[:, None]), mask=live[:, None])
            tl.store(sin_ptr + out_at, tl.load(sin_table_ptr + table_at, mask=live[:, None]), mask=live[:, None])

    return target_setup_kernel, drafter_setup_kernel


def target_setup(
    length: torch.Tensor, positions: torch.Tensor, tree_mask: torch.Tensor, stored_positions: torch.Tensor,
    table: tuple[torch.Tensor, torch.Tensor], bucket: int, dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """length: [1] long; positions: [rows] long; tree_mask: [rows, rows] bool (contiguous); stored_positions:
    [capacity] long (written at the new slots); table: rotary cos, sin [positions, head_dim] -> slots [rows] long,
    additive mask [rows, bucket] in `dtype`, cos, sin [rows, head_dim]."""
    rows = positions.shape[0]
    cos_table, sin_table = table
    head_dim = cos_table.shape[1]
    device = positions.device
    slots = torch.empty(rows, dtype=torch.long, device=device)
    additive = torch.empty((rows, bucket), dtype=dtype, device=device)
    cos = torch.empty((rows, head_dim), dtype=cos_table.dtype, device=device)
    sin = torch.empty_like(cos)
    _kernels()[0][(-(-bucket // COLUMNS),)](
        length, positions, tree_mask.view(torch.uint8), stored_positions, cos_table, sin_table,
        slots, additive, cos, sin, rows, bucket,
        ROWS=max(2, next_power_of_two(rows)), COLUMNS=COLUMNS, HEAD_DIM=head_dim, num_warps=4,
    )
    return slots, additive, cos, sin


def drafter_setup(
    start: torch.Tensor, new_rows: torch.Tensor, block: int, stored_positions: torch.Tensor,
    table: tuple[torch.Tensor, torch.Tensor], bucket: int, dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """start, new_rows: [1] long; stored_positions: [capacity] long (the context positions are written at their own
    slots); table: rotary cos, sin [positions, head_dim] -> slots [2B] long, additive mask row [bucket] in `dtype`,
    cos, sin [2B, head_dim] (context rows, then block rows)."""
    cos_table, sin_table = table
    head_dim = cos_table.shape[1]
    device = start.device
    slots = torch.empty(2 * block, dtype=torch.long, device=device)
    additive = torch.empty(bucket, dtype=dtype, device=device)
    cos = torch.empty((2 * block, head_dim), dtype=cos_table.dtype, device=device)
    sin = torch.empty_like(cos)
    _kernels()[1][(-(-bucket // COLUMNS),)](
        start, new_rows, stored_positions, cos_table, sin_table, slots, additive, cos, sin, bucket,
        BLOCK=block, ROWS=next_power_of_two(2 * block), COLUMNS=COLUMNS, HEAD_DIM=head_dim, num_warps=4,
    )
    return slots, additive, cos, sin
