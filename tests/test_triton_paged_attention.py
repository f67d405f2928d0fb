"""The paged attention program (`dflash.kernels.triton_paged_attention`) against the gather + masked softmax it
replaces: GQA, trees, padding rows and requests, keys over several slices, slots scattered over the pool and shared
between requests."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from dflash.kernels.triton_paged_attention import paged_attention
from dflash.kernels.triton_tree import tree_kernel_usable

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(not tree_kernel_usable(DEVICE), reason="needs Triton (a GPU, or TRITON_INTERPRET=1)")


@dataclass
class PagedCase:
    q: torch.Tensor  # [b, heads, r, head_dim]
    keys: torch.Tensor  # [kv_heads, slots, head_dim]
    values: torch.Tensor
    read_slots: torch.Tensor  # [b, k] int64
    past: torch.Tensor  # [b] int64
    counts: torch.Tensor  # [b] int64
    visibility: torch.Tensor  # [b, r, r] bool

    def to(self, dtype: torch.dtype) -> PagedCase:
        q, keys, values = (t.to(DEVICE, dtype) for t in (self.q, self.keys, self.values))
        rest = (t.to(DEVICE) for t in (self.read_slots, self.past, self.counts, self.visibility))
        return PagedCase(q, keys, values, *rest)


def make_case(
    lengths: list[tuple[int, int]], rows: int, keys: int, heads: int, kv_heads: int, head_dim: int, seed: int,
    shared_prefix: int = 0,
) -> PagedCase:
    """Requests of (committed keys, new rows) each (0 rows: a padding request) in a pool whose slots are a random
    permutation; the second request's first `shared_prefix` keys are the first request's slots. Every slot no
    request may read holds NaN, and so do the slots named past each request's keys (a padding request reads key 0
    at the trash slot, the last, which holds zeros)."""
    generator = torch.Generator().manual_seed(seed)
    count = len(lengths)
    used = sum(past + new for past, new in lengths)
    capacity = used + 50
    order = torch.randperm(capacity, generator=generator)
    trash, unwritten = capacity, int(order[-1])
    read = torch.full((count, keys), unwritten, dtype=torch.long)
    read[:, 0] = trash
    taken = 0
    for index, (past, new) in enumerate(lengths):
        read[index, : past + new] = order[taken : taken + past + new]
        taken += past + new
    if shared_prefix:
        read[1, :shared_prefix] = read[0, :shared_prefix]
    pool_keys = torch.full((kv_heads, capacity + 1, head_dim), float("nan"))
    pool_values = torch.full((kv_heads, capacity + 1, head_dim), float("nan"))
    pool_keys[:, trash] = 0
    pool_values[:, trash] = 0
    for index, (past, new) in enumerate(lengths):
        slots = read[index, : past + new]
        pool_keys[:, slots] = torch.randn((kv_heads, past + new, head_dim), generator=generator)
        pool_values[:, slots] = torch.randn((kv_heads, past + new, head_dim), generator=generator)
    if shared_prefix:
        assert lengths[0][0] >= shared_prefix and lengths[1][0] >= shared_prefix
    # a tree among each request's real rows: every row sees itself and some earlier rows; padding rows see none
    visibility = torch.zeros((count, rows, rows), dtype=torch.bool)
    for index, (_, new) in enumerate(lengths):
        tree = (torch.rand((new, new), generator=generator) < 0.5).tril(-1) | torch.eye(new, dtype=torch.bool)
        visibility[index, :new, :new] = tree
    q = torch.randn((count, heads, rows, head_dim), generator=generator)
    past_t = torch.tensor([past for past, _ in lengths], dtype=torch.long)
    counts_t = torch.tensor([new for _, new in lengths], dtype=torch.long)
    return PagedCase(q, pool_keys, pool_values, read, past_t, counts_t, visibility)


def reference(case: PagedCase, scale: float) -> torch.Tensor:
    """Gather + masked softmax in float64 -> [b, heads, r, head_dim]: row i sees the committed keys, the new rows
    its visibility allows, and key 0 (the padded batch's `full_mask`)."""
    q, read = case.q.double(), case.read_slots
    b, heads, rows, _ = q.shape
    kv_heads, keys = case.keys.shape[0], read.shape[1]
    positions = torch.arange(keys, device=read.device)
    relative = positions[None] - case.past[:, None]  # [b, k]
    new = (relative >= 0) & (relative < case.counts[:, None])
    among = case.visibility.gather(2, relative.clamp(0, rows - 1)[:, None, :].expand(b, rows, keys))  # [b, r, k]
    visible = (relative < 0)[:, None, :] | (among & new[:, None, :])
    visible[..., 0] = True
    readable = (positions[None] < (case.past + case.counts).clamp(min=1)[:, None])[:, None, :, None]  # [b, 1, k, 1]
    # [b, kv_heads, k, hd]: keys past a request's own are hidden from every row (and never read by the program)
    gathered_k = torch.where(readable, case.keys.double()[:, read].transpose(0, 1), 0.0)
    gathered_v = torch.where(readable, case.values.double()[:, read].transpose(0, 1), 0.0)
    group = heads // kv_heads
    gathered_k = gathered_k.repeat_interleave(group, dim=1)
    gathered_v = gathered_v.repeat_interleave(group, dim=1)
    scores = (q @ gathered_k.transpose(-1, -2)) * scale  # [b, heads, r, k]
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    return torch.softmax(scores, dim=-1) @ gathered_v


CASES = [
    # (lengths, rows, keys, heads, kv_heads, head_dim, min_slice)
    ([(9, 1), (30, 1)], 1, 128, 4, 4, 16, 256),  # one-row steps, one slice
    ([(40, 5), (0, 0), (17, 3), (0, 3)], 8, 128, 9, 3, 64, 64),  # trees, padding rows and a padding request
    ([(200, 16), (90, 7)], 16, 256, 8, 2, 32, 64),  # GQA groups of 4, four slices, keys past a request skipped
    ([(300, 4), (280, 4), (0, 0), (5, 2)], 4, 512, 32, 8, 128, 128),  # the 8B model's heads, shared prefix
    ([(100, 24), (60, 30)], 32, 256, 9, 3, 64, 64),  # 96 rows of a group: two row blocks per request
]


@pytest.mark.parametrize(("lengths", "rows", "keys", "heads", "kv_heads", "head_dim", "min_slice"), CASES)
def test_paged_attention_matches_the_gathered_reference(
    lengths: list[tuple[int, int]], rows: int, keys: int, heads: int, kv_heads: int, head_dim: int, min_slice: int
) -> None:
    """float32 (exact products): every row, real or padding, equals the float64 gather + masked softmax; no slot
    past a request's keys is read (they hold NaN)."""
    shared = 100 if lengths[0][0] > 100 and len(lengths) == 4 else 0
    case = make_case(lengths, rows, keys, heads, kv_heads, head_dim, seed=len(lengths) * 100 + keys,
                     shared_prefix=shared).to(torch.float32)
    scale = head_dim**-0.5
    out = paged_attention(case.q, case.keys, case.values, case.read_slots, case.past, case.counts, case.visibility,
                          scale, min_slice=min_slice)
    assert out.shape == case.q.shape and torch.isfinite(out).all()
    expected = reference(case, scale).float()
    torch.testing.assert_close(out, expected, rtol=2e-5, atol=2e-5)


def test_q_strided_like_the_fused_pass_and_the_output_layout() -> None:
    """q as the fused pass hands it (a [b, heads, r, hd] view of the QKV product's rows) gives the contiguous q's
    result, and the output is a view of [b, r, heads, hd] rows (the output product reads it without a copy)."""
    case = make_case([(50, 3), (20, 4)], 4, 128, 4, 2, 32, seed=7).to(torch.float32)
    b, heads, rows, dim = case.q.shape
    width = (heads + 2 * 2) * dim
    qkv = torch.randn((b * rows, width), device=DEVICE)
    qkv[:, : heads * dim] = case.q.transpose(1, 2).reshape(b * rows, heads * dim)
    strided = qkv[:, : heads * dim].view(b, rows, heads, dim).transpose(1, 2)
    out = paged_attention(strided, case.keys, case.values, case.read_slots, case.past, case.counts,
                          case.visibility, 0.2, min_slice=64)
    contiguous = paged_attention(case.q.contiguous(), case.keys, case.values, case.read_slots, case.past,
                                 case.counts, case.visibility, 0.2, min_slice=64)
    assert torch.equal(out, contiguous)
    assert out.transpose(1, 2).is_contiguous()
    torch.testing.assert_close(out, reference(case, 0.2).float(), rtol=2e-5, atol=2e-5)


def test_half_precision_follows_the_reference() -> None:
    """fp16 inputs (fp32 accumulation): within fp16 rounding of the float64 reference."""
    case = make_case([(70, 5), (0, 0), (33, 2)], 8, 128, 9, 3, 64, seed=3)
    half = case.to(torch.float16)
    out = paged_attention(half.q, half.keys, half.values, half.read_slots, half.past, half.counts, half.visibility,
                          0.125, min_slice=64)
    assert out.dtype == torch.float16
    expected = reference(case.to(torch.float16), 0.125).float()
    torch.testing.assert_close(out.float(), expected, rtol=1e-2, atol=1e-2)


# Triton's CPU interpreter keeps bf16 as raw 16-bit integers and feeds them to `tl.dot` unconverted.
@pytest.mark.skipif(DEVICE.type != "cuda", reason="bf16 products: the Triton interpreter multiplies their raw bits")
@pytest.mark.parametrize(("keys", "min_slice"), [(256, 256), (2048, 256)])
def test_bf16_follows_the_reference(keys: int, min_slice: int) -> None:
    """bf16 (products rounded to bf16 weights, fp32 accumulation): within 2e-2 of the float64 reference, for one
    slice and for many."""
    lengths = [(keys - 40, 32), (keys // 3, 9), (0, 0), (5, 1)]
    case = make_case(lengths, 32, keys, 32, 8, 128, seed=keys, shared_prefix=4)
    low = case.to(torch.bfloat16)
    out = paged_attention(low.q, low.keys, low.values, low.read_slots, low.past, low.counts, low.visibility,
                          128**-0.5, min_slice=min_slice)
    expected = reference(case.to(torch.bfloat16), 128**-0.5).float()
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA graphs")
def test_paged_attention_in_a_replayed_graph() -> None:
    """Captured once and replayed over changed lengths, slots and queries, the output follows the reference on
    every replay (the launch depends on the shapes alone)."""
    case = make_case([(600, 16), (300, 5), (0, 0)], 16, 1024, 9, 3, 64, seed=11).to(torch.bfloat16)
    call = (case.q, case.keys, case.values, case.read_slots, case.past, case.counts, case.visibility, 0.125)
    paged_attention(*call)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_attention(*call)
    generator = torch.Generator().manual_seed(5)
    for step in range(3):  # shorter and longer requests over the same pool slots, new queries and trees
        case.past.copy_(torch.tensor([500 - 150 * step, 100 * step, 0]))
        case.counts.copy_(torch.tensor([16 - step, 3 + step, 0]))
        case.visibility.copy_(torch.rand(case.visibility.shape, generator=generator) < 0.5)
        case.q.copy_(torch.randn(case.q.shape, generator=generator))
        graph.replay()
        torch.testing.assert_close(out.float(), reference(case, 0.125).float(), rtol=2e-2, atol=2e-2)
