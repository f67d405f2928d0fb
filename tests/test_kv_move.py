"""The Triton K/V row move of a DDTree round (`dflash.kernels.triton_kv_move`) against torch's gather + scatter."""

from __future__ import annotations

import pytest
import torch

from dflash.kernels.triton_tree import tree_kernel_usable

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.skipif(not tree_kernel_usable(DEVICE), reason="needs Triton (a GPU, or TRITON_INTERPRET=1)")
@pytest.mark.parametrize("path", [[0, 1, 2, 3], [0, 2, 5, 9, 13], [0, 3, 4, 0, 0, 0]])
def test_moving_the_path_rows_matches_torch(path: list[int]) -> None:
    """Paths whose rows overlap the slots they move to (row 2 moves to slot 1 while row 5 moves to slot 2...);
    entries past the accepted length (row 0 again) move too, as in the torch version."""
    generator = torch.Generator().manual_seed(len(path))
    keys = torch.randn((3, 1, 2, 40, 16), generator=generator).to(DEVICE, torch.bfloat16)
    values = torch.randn((3, 1, 2, 40, 16), generator=generator).to(DEVICE, torch.bfloat16)
    positions = torch.arange(40, device=DEVICE)[None] * 7  # [1, capacity], not yet the slots' own
    length = torch.tensor([11], device=DEVICE)
    rows = torch.tensor(path, device=DEVICE)
    expected_keys, expected_values, expected_positions = keys.clone(), values.clone(), positions.clone()
    source, dest = length + rows, length + torch.arange(len(path), device=DEVICE)
    expected_keys.index_copy_(3, dest, expected_keys.index_select(3, source))
    expected_values.index_copy_(3, dest, expected_values.index_select(3, source))
    expected_positions[0].index_copy_(0, dest, dest)

    from dflash.kernels.triton_kv_move import move_path_rows

    move_path_rows(keys, values, positions[0], length, rows)
    assert torch.equal(keys, expected_keys)
    assert torch.equal(values, expected_values)
    assert torch.equal(positions, expected_positions)


@pytest.mark.skipif(not tree_kernel_usable(DEVICE), reason="needs Triton (a GPU, or TRITON_INTERPRET=1)")
def test_moving_the_path_rows_also_gathers_their_features() -> None:
    """The accepted rows' features land in rows 0.. of the destination, spread over the K/V programs (a feature
    width that is not a multiple of the programs' column share); the K/V move is unchanged."""
    from dflash.kernels.triton_kv_move import move_path_rows

    generator = torch.Generator().manual_seed(5)
    keys = torch.randn((3, 1, 2, 40, 16), generator=generator).to(DEVICE, torch.bfloat16)
    values = torch.randn((3, 1, 2, 40, 16), generator=generator).to(DEVICE, torch.bfloat16)
    positions = torch.zeros(40, dtype=torch.long, device=DEVICE)
    rows = torch.tensor([0, 2, 3, 7, 8], device=DEVICE)
    source = torch.randn((12, 50), generator=generator).to(DEVICE, torch.bfloat16)
    destination = torch.zeros((6, 50), dtype=torch.bfloat16, device=DEVICE)
    expected_keys = keys.clone()
    move_path_rows(expected_keys, values.clone(), positions.clone(), torch.tensor([4], device=DEVICE), rows)
    move_path_rows(keys, values, positions, torch.tensor([4], device=DEVICE), rows, features=(source, destination))
    assert torch.equal(keys, expected_keys)
    assert torch.equal(destination[:5], source[rows])
    assert not destination[5].any()


@pytest.mark.skipif(not tree_kernel_usable(DEVICE), reason="needs Triton (a GPU, or TRITON_INTERPRET=1)")
def test_moving_every_request_s_path_in_the_pool_matches_torch() -> None:
    """The batched step's move (`move_tree_paths`): each request's accepted path rows, through its own block table
    (blocks out of order, a path crossing a block boundary), move to the positions right after its committed prefix
    in every layer and head, and their features become its context rows; a padding request
    and the steps past each path's length move nothing."""
    from dflash.kernels.triton_kv_move import move_tree_paths

    generator = torch.Generator().manual_seed(9)
    layers, heads, blocks, size, head_dim, width = 3, 2, 12, 4, 16, 40
    slots = blocks * size + 1  # and the trash slot
    keys = torch.randn((layers, heads, slots, head_dim), generator=generator).to(DEVICE, torch.bfloat16)
    values = torch.randn((layers, heads, slots, head_dim), generator=generator).to(DEVICE, torch.bfloat16)
    tables = torch.tensor([[5, 2, 9, 0], [7, 1, 3, 11], [4, 6, 8, 10]], device=DEVICE)  # [requests, key blocks]
    past = torch.tensor([6, 2, 0], device=DEVICE)
    counts = torch.tensor([8, 8, 0], device=DEVICE)  # the third request is padding
    paths = torch.tensor([[0, 2, 5, 6], [0, 1, 3, 0], [0, 3, 4, 5]], device=DEVICE)  # [requests, depth + 1]
    lengths = torch.tensor([4, 3, 4], device=DEVICE)
    features = torch.randn((3, 8, width), generator=generator).to(DEVICE, torch.bfloat16)
    context = torch.zeros((4, 5, width), dtype=torch.bfloat16, device=DEVICE)
    expected_keys, expected_values, expected_context = keys.clone(), values.clone(), context.clone()
    for request in range(2):  # the torch form: gather every source, then scatter
        def slot(position: int, request: int = request) -> int:
            return int(tables[request, position // size]) * size + position % size

        count = int(lengths[request])
        source = [slot(int(past[request]) + int(paths[request, i])) for i in range(count)]
        dest = [slot(int(past[request]) + i) for i in range(count)]
        for storage in (expected_keys, expected_values):
            storage[:, :, dest] = storage[:, :, source]
        expected_context[request, :count] = features[request, paths[request, :count]]
    move_tree_paths(keys, values, tables, size, past, counts, paths, lengths, features, context)
    assert torch.equal(keys, expected_keys)
    assert torch.equal(values, expected_values)
    assert torch.equal(context, expected_context)
