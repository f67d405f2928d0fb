"""Moving a DDTree round's accepted K/V rows next to the committed prefix, as one Triton program per plane.

After a tree verification the cache holds one K/V row per tree node at slots ``length + row``; the accepted path's
rows must move to slots ``length, length + 1, ...`` (and their positions be reset) before the next round. torch
needs a gather and a scatter per tensor (four kernels with a temporary copy); here each (layer, batch, kv head)
plane of the cache is one program that loads the path's rows, waits for its threads, and stores them at their new
slots (the path's row at depth i is at slot ``length + i`` or later, so the loads must finish before the stores).
The same programs can also gather the accepted rows' captured target features (the drafter's next context rows),
each a slice of the columns.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import torch

from dflash.kernels.triton_decode import next_power_of_two


@cache
def _kernel() -> tuple[Any, Any]:
    import triton
    import triton.language as tl

    @triton.jit
    def move_rows_kernel(  # type: ignore[no-untyped-def]
        keys_ptr, values_ptr, positions_ptr, length_ptr, path_ptr, count, capacity,
        feature_src_ptr, feature_dst_ptr, feature_width,
        S: tl.constexpr, HEAD_DIM: tl.constexpr, FEATURE_COLUMNS: tl.constexpr,
    ):
        plane = tl.program_id(0).to(tl.int64)
        step = tl.arange(0, S)
        dims = tl.arange(0, HEAD_DIM)
        moving = step < count
        length = tl.load(length_ptr)
        source = length + tl.load(path_ptr + step, mask=moving, other=0)  # [S]
        dest = length + step
        base = plane * capacity * HEAD_DIM
        inside = moving[:, None]
        keys = tl.load(keys_ptr + base + source[:, None] * HEAD_DIM + dims[None, :], mask=inside)
        values = tl.load(values_ptr + base + source[:, None] * HEAD_DIM + dims[None, :], mask=inside)
        tl.debug_barrier()
        tl.store(keys_ptr + base + dest[:, None] * HEAD_DIM + dims[None, :], keys, mask=inside)
        tl.store(values_ptr + base + dest[:, None] * HEAD_DIM + dims[None, :], values, mask=inside)
        if plane == 0:
            tl.store(positions_ptr + dest, dest, mask=moving)
        if FEATURE_COLUMNS > 0:  # this plane's share of the feature columns: path rows gathered to rows 0..count-1
            columns = plane * FEATURE_COLUMNS + tl.arange(0, FEATURE_COLUMNS)
            rows = tl.load(path_ptr + step, mask=moving, other=0)
            inside_features = moving[:, None] & (columns[None, :] < feature_width)
            gathered = tl.load(feature_src_ptr + rows[:, None] * feature_width + columns[None, :], mask=inside_features)
            tl.store(feature_dst_ptr + step[:, None] * feature_width + columns[None, :], gathered, mask=inside_features)

    @triton.jit
    def move_paths_kernel(  # type: ignore[no-untyped-def]
        keys_ptr, values_ptr, blocks_ptr, key_blocks, block_size, slots, past_ptr, counts_ptr, paths_ptr,
        lengths_ptr, depth, feature_src_ptr, feature_rows, feature_dst_ptr, context_block, feature_width,
        S: tl.constexpr, HEAD_DIM: tl.constexpr, FEATURE_COLUMNS: tl.constexpr,
    ):
        request = tl.program_id(0).to(tl.int64)
        plane = tl.program_id(1).to(tl.int64)
        step = tl.arange(0, S)
        dims = tl.arange(0, HEAD_DIM)
        rows_verified = tl.load(counts_ptr + request) + step * 0  # [S]; 0 for a padding request: nothing moves
        moving = (step < tl.load(lengths_ptr + request)) & (step < depth + 1) & (rows_verified > 0)
        past = tl.load(past_ptr + request)
        rows = tl.load(paths_ptr + request * (depth + 1) + step, mask=moving, other=0)  # [S]
        source_position = past + rows
        dest_position = past + step
        table = blocks_ptr + request * key_blocks
        source_block = tl.load(table + tl.minimum(source_position // block_size, key_blocks - 1), mask=moving, other=0)
        dest_block = tl.load(table + tl.minimum(dest_position // block_size, key_blocks - 1), mask=moving, other=0)
        source = source_block * block_size + source_position % block_size  # [S] pool slots
        dest = dest_block * block_size + dest_position % block_size
        base = plane * slots * HEAD_DIM
        inside = moving[:, None]
        keys = tl.load(keys_ptr + base + source[:, None] * HEAD_DIM + dims[None, :], mask=inside)
        values = tl.load(values_ptr + base + source[:, None] * HEAD_DIM + dims[None, :], mask=inside)
        tl.debug_barrier()  # a path row may sit at another step's destination: every load before any store
        tl.store(keys_ptr + base + dest[:, None] * HEAD_DIM + dims[None, :], keys, mask=inside)
        tl.store(values_ptr + base + dest[:, None] * HEAD_DIM + dims[None, :], values, mask=inside)
        if FEATURE_COLUMNS > 0:  # this plane's share of the feature columns: the path rows' features in turn
            columns = plane * FEATURE_COLUMNS + tl.arange(0, FEATURE_COLUMNS)
            inside_features = moving[:, None] & (columns[None, :] < feature_width)
            gathered = tl.load(
                feature_src_ptr + (request * feature_rows + rows[:, None]) * feature_width + columns[None, :],
                mask=inside_features,
            )
            tl.store(
                feature_dst_ptr + (request * context_block + step[:, None]) * feature_width + columns[None, :],
                gathered.to(feature_dst_ptr.dtype.element_ty), mask=inside_features,
            )

    return move_rows_kernel, move_paths_kernel


def move_usable(keys: torch.Tensor, values: torch.Tensor) -> bool:
    """Whether `move_path_rows` takes this cache layout (contiguous planes, a power-of-two head dim)."""
    head_dim = keys.shape[-1]
    return keys.is_contiguous() and values.is_contiguous() and head_dim == next_power_of_two(head_dim)


def move_path_rows(
    keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, length: torch.Tensor, path: torch.Tensor,
    features: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """keys, values: [layers, batch, kv_heads, capacity, head_dim] contiguous; positions: [capacity] long (the
    first batch row's); length: [1] long, the committed prefix; path: [count] long rows from the root. Slot
    ``length + path[i]`` moves to ``length + i`` in every plane, and ``positions[length + i] = length + i``.
    `features` (source [rows, width], destination [>= count, width], contiguous, one dtype): also
    ``destination[i] = source[path[i]]``, spread over the same programs."""
    layers, batch, heads, capacity, head_dim = keys.shape
    assert move_usable(keys, values)
    count = path.shape[0]
    planes = layers * batch * heads
    source, destination = features if features is not None else (keys, keys)
    width = source.shape[-1] if features is not None else 0
    if features is not None:
        assert source.is_contiguous() and destination.is_contiguous() and source.dtype == destination.dtype
    _kernel()[0][(planes,)](
        keys, values, positions, length, path, count, capacity, source, destination, width,
        S=next_power_of_two(count), HEAD_DIM=head_dim,
        FEATURE_COLUMNS=next_power_of_two(-(-width // planes)) if width else 0, num_warps=2,
    )


def pool_move_usable(keys: torch.Tensor, values: torch.Tensor) -> bool:
    """Whether `move_tree_paths` takes this pool (contiguous, a power-of-two head dim) on this device."""
    from dflash.kernels.triton_tree import tree_kernel_usable

    return tree_kernel_usable(keys.device) and move_usable(keys, values)


def move_tree_paths(
    keys: torch.Tensor, values: torch.Tensor, blocks: torch.Tensor, block_size: int, past: torch.Tensor,
    counts: torch.Tensor, paths: torch.Tensor, lengths: torch.Tensor, features: torch.Tensor, context: torch.Tensor,
) -> None:
    """Every request's accepted path after a batched tree verification, one program per (request, K/V plane).
    keys, values: the pool, [layers, kv_heads, slots, head_dim] contiguous; blocks: [requests, key_blocks] long
    (each request's table); past, counts, lengths: [requests] long; paths: [requests, depth + 1] long rows from the
    root. For each request with rows (counts > 0) and each step i < lengths: position past + paths[i] moves to
    position past + i in every plane, and context[request, i] = features[request, paths[i]] (features: [requests,
    rows, F] contiguous; context: [>= requests, block, F] contiguous, any float dtype)."""
    layers, heads, slots, head_dim = keys.shape
    assert move_usable(keys, values) and features.is_contiguous() and context.is_contiguous()
    requests, steps = paths.shape
    planes = layers * heads
    width = features.shape[-1]
    _kernel()[1][(requests, planes)](
        keys, values, blocks, blocks.shape[1], block_size, slots, past, counts, paths, lengths, steps - 1,
        features, features.shape[1], context, context.shape[1], width,
        S=next_power_of_two(steps), HEAD_DIM=head_dim, FEATURE_COLUMNS=next_power_of_two(-(-width // planes)),
        num_warps=2,
    )
