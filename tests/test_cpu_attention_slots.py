"""The fused CPU attention over a paged K/V pool (`cpu_layer_ops.attention_slots`): bitwise the contiguous
`attention` over the keys and values gathered through the slots, on the AVX-512 rows (head sizes 64 and 128) and
on the portable path (other head sizes here, and every head size in a build without AVX-512)."""

from __future__ import annotations

import pytest
import torch

from dflash.kernels.build import KernelUnavailable, LayerOpsKernel, load_layer_ops

PORTABLE_FLAGS = ("-mno-avx512f",)


@pytest.fixture(scope="module")
def ops() -> LayerOpsKernel:
    try:
        return load_layer_ops()
    except KernelUnavailable as exc:  # pragma: no cover - machines without a compiler
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def portable_ops() -> LayerOpsKernel:
    try:
        return load_layer_ops(PORTABLE_FLAGS)
    except KernelUnavailable as exc:  # pragma: no cover - machines without a compiler (or these flags)
        pytest.skip(str(exc))


def gathered(
    ops: LayerOpsKernel,
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slots: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """The reference: the request's keys and values copied out of the pool, then the contiguous kernel."""
    k = k_pool[:, slots][None]  # [1, kv_heads, keys, head_dim]
    v = v_pool[:, slots][None]
    out: torch.Tensor = ops.attention(q[None], k, v, None if mask is None else mask[None, None], scale)
    return out[0]  # [rows, heads * head_dim]


def pool_layer(kv_heads: int, slots: int, head_dim: int, token_major: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer of a 3-layer pool [kv_heads, slots, head_dim]: head-major storage, or token-major (stored
    [slots, kv_heads, head_dim], so the stride over slots is kv_heads * head_dim)."""
    if token_major:
        keys = torch.randn(3, slots, kv_heads, head_dim).transpose(1, 2)
        values = torch.randn(3, slots, kv_heads, head_dim).transpose(1, 2)
    else:
        keys, values = torch.randn(3, kv_heads, slots, head_dim), torch.randn(3, kv_heads, slots, head_dim)
    return keys[1], values[1]


def row_mask(kind: str, rows: int, keys: int, generator: torch.Generator) -> torch.Tensor | None:
    """[rows, keys] visibility: the rows are the last `rows` keys' queries. causal: each sees the past and the
    rows up to its own; tree: the past, a random subset of the other rows and always itself."""
    if kind == "none":
        return None
    past = keys - rows
    if kind == "causal":
        return torch.ones(rows, keys, dtype=torch.bool).tril(past)
    mask = torch.rand(rows, keys, generator=generator) > 0.5
    mask[:, :past] = True
    mask[torch.arange(rows), past + torch.arange(rows)] = True
    return mask


def check_slots_equal_gathered(
    ops: LayerOpsKernel, heads: int, kv_heads: int, head_dim: int, mask_kind: str, rows: int, seed: int
) -> None:
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    shapes = ((rows, rows + 3, False), (37, 300, True), (130, 200, False), (301, 512, True))
    for keys, pool_slots, token_major in shapes:  # (keys, pool slots, token-major storage)
        if keys < rows:
            continue
        k_pool, v_pool = pool_layer(kv_heads, pool_slots, head_dim, token_major)
        slots = torch.randperm(pool_slots, generator=generator)[:keys]  # scattered, in no particular order
        q = torch.randn(rows, heads, head_dim).transpose(0, 1)  # [heads, rows, head_dim] view, as the layers hold it
        mask = row_mask(mask_kind, rows, keys, generator)
        want = gathered(ops, q, k_pool, v_pool, slots, mask, 0.125)
        got = ops.attention_slots(q, k_pool, v_pool, slots, mask, 0.125)
        assert got.shape == (rows, heads * head_dim) and got.is_contiguous()
        assert torch.equal(got, want), (keys, pool_slots, token_major)


@pytest.mark.parametrize("rows", [1, 5, 16, 40])
@pytest.mark.parametrize("mask_kind", ["causal", "tree", "none"])
@pytest.mark.parametrize("head_dim", [64, 128, 48, 36])  # 64 / 128: AVX-512 rows where built; 36: no 8-wide dots
@pytest.mark.parametrize(("heads", "kv_heads"), [(6, 2), (3, 3)])
def test_slots_are_bitwise_the_gathered_attention(
    ops: LayerOpsKernel, heads: int, kv_heads: int, head_dim: int, mask_kind: str, rows: int
) -> None:
    check_slots_equal_gathered(ops, heads, kv_heads, head_dim, mask_kind, rows, seed=rows * 7 + head_dim)


@pytest.mark.parametrize("rows", [1, 16])
@pytest.mark.parametrize("mask_kind", ["tree", "none"])
@pytest.mark.parametrize("head_dim", [64, 128, 48])  # 64: the portable path's register-held value sums
def test_portable_build_slots_are_bitwise_the_gathered_attention(
    portable_ops: LayerOpsKernel, head_dim: int, mask_kind: str, rows: int
) -> None:
    check_slots_equal_gathered(portable_ops, 6, 2, head_dim, mask_kind, rows, seed=rows + head_dim)


def test_a_row_reads_only_its_own_slots(ops: LayerOpsKernel) -> None:
    """Writing over every slot the request does not own changes nothing; writing over one it owns does."""
    torch.manual_seed(11)
    k_pool, v_pool = pool_layer(2, 256, 64, token_major=False)
    slots = torch.randperm(256)[:100]
    q = torch.randn(6, 3, 64)
    before = ops.attention_slots(q, k_pool, v_pool, slots, None, 0.125)
    others = torch.ones(256, dtype=torch.bool)
    others[slots] = False
    k_pool[:, others], v_pool[:, others] = 1e4, -1e4
    assert torch.equal(ops.attention_slots(q, k_pool, v_pool, slots, None, 0.125), before)
    v_pool[:, slots[57]] += 1.0
    assert not torch.equal(ops.attention_slots(q, k_pool, v_pool, slots, None, 0.125), before)


def test_bad_arguments_are_refused(ops: LayerOpsKernel) -> None:
    k_pool, v_pool = pool_layer(2, 64, 64, token_major=False)
    q = torch.randn(6, 2, 64)
    with pytest.raises(RuntimeError, match="outside the pool"):
        ops.attention_slots(q, k_pool, v_pool, torch.tensor([3, 64]), None, 0.125)
    with pytest.raises(RuntimeError, match="outside the pool"):
        ops.attention_slots(q, k_pool, v_pool, torch.tensor([-1, 5]), None, 0.125)
    with pytest.raises(RuntimeError, match="int64"):
        ops.attention_slots(q, k_pool, v_pool, torch.tensor([3, 5], dtype=torch.int32), None, 0.125)
    with pytest.raises(RuntimeError, match="mask"):
        ops.attention_slots(q, k_pool, v_pool, torch.tensor([3, 5]), torch.ones(2, 3, dtype=torch.bool), 0.125)
    with pytest.raises(RuntimeError, match="multiple"):
        ops.attention_slots(torch.randn(5, 2, 64), k_pool, v_pool, torch.tensor([3, 5]), None, 0.125)


def check_segments_equal_each_segment(ops: LayerOpsKernel, heads: int, kv_heads: int, head_dim: int, seed: int) -> None:
    """Requests of 1 to 16 rows, with and without masks, over different numbers of keys, packed into one q: one
    call gives bitwise each request's own `attention_slots`."""
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    k_pool, v_pool = pool_layer(kv_heads, 700, head_dim, token_major=seed % 2 == 1)
    requests = [(1, 40, "none"), (5, 130, "tree"), (16, 16, "causal"), (1, 1, "none"), (3, 301, "causal")]
    q = torch.randn(sum(rows for rows, _, _ in requests), heads, head_dim).transpose(0, 1)  # [heads, R, head_dim]
    starts, counts, slots, masks, want = [], [], [], [], []
    start = 0
    for rows, keys, mask_kind in requests:
        own = torch.randperm(700, generator=generator)[:keys]
        mask = row_mask(mask_kind, rows, keys, generator)
        starts.append(start), counts.append(rows), slots.append(own), masks.append(mask)
        want.append(ops.attention_slots(q[:, start : start + rows], k_pool, v_pool, own, mask, 0.125))
        start += rows
    got = ops.attention_segments(q, k_pool, v_pool, starts, counts, slots, masks, 0.125)
    assert got.shape == (start, heads * head_dim) and got.is_contiguous()
    assert torch.equal(got, torch.cat(want))


@pytest.mark.parametrize("head_dim", [64, 128, 48])
@pytest.mark.parametrize(("heads", "kv_heads"), [(6, 2), (3, 3)])
def test_segments_are_bitwise_each_segments_attention(
    ops: LayerOpsKernel, heads: int, kv_heads: int, head_dim: int
) -> None:
    check_segments_equal_each_segment(ops, heads, kv_heads, head_dim, seed=head_dim + heads)


@pytest.mark.parametrize("head_dim", [64, 48])
def test_portable_build_segments_are_bitwise_each_segments_attention(
    portable_ops: LayerOpsKernel, head_dim: int
) -> None:
    check_segments_equal_each_segment(portable_ops, 6, 2, head_dim, seed=head_dim + 1)


def test_segments_must_cover_the_rows_in_order(ops: LayerOpsKernel) -> None:
    k_pool, v_pool = pool_layer(2, 64, 64, token_major=False)
    q = torch.randn(6, 4, 64)
    slots = [torch.arange(10), torch.arange(20)]
    with pytest.raises(RuntimeError, match="in order"):
        ops.attention_segments(q, k_pool, v_pool, [0, 3], [2, 2], slots, [None, None], 0.125)
    with pytest.raises(RuntimeError, match="cover 3 rows, q has 4"):
        ops.attention_segments(q, k_pool, v_pool, [0, 2], [2, 1], slots, [None, None], 0.125)
    with pytest.raises(RuntimeError, match="outside the pool"):
        ops.attention_segments(q, k_pool, v_pool, [0, 2], [2, 2], [slots[0], torch.tensor([64])], [None, None], 0.125)
    with pytest.raises(RuntimeError, match="one entry per segment"):
        ops.attention_segments(q, k_pool, v_pool, [0, 2], [2, 2], slots[:1], [None, None], 0.125)
