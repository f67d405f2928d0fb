"""The split-key attention program (`dflash.kernels.triton_attention`) against torch's SDPA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dflash.kernels.triton_attention import few_row_attention
from dflash.kernels.triton_tree import tree_kernel_usable

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(not tree_kernel_usable(DEVICE), reason="needs Triton (a GPU, or TRITON_INTERPRET=1)")


@pytest.mark.parametrize(
    ("rows", "heads", "kv_heads", "head_dim", "bucket"),
    [(1, 9, 3, 64, 100), (16, 9, 3, 64, 300), (5, 4, 4, 16, 64), (33, 8, 2, 32, 200), (3, 32, 8, 128, 1500)],
)
def test_few_row_attention_matches_sdpa(rows: int, heads: int, kv_heads: int, head_dim: int, bucket: int) -> None:
    """float32 (exact products): equal to SDPA with GQA under a mask that hides a random part of the context and
    whole key slices from some rows, up to summation order."""
    generator = torch.Generator().manual_seed(rows * 1000 + bucket)
    capacity = bucket + 37
    q = torch.randn((rows, heads, head_dim), generator=generator).to(DEVICE)
    keys = torch.randn((kv_heads, capacity, head_dim), generator=generator).to(DEVICE)
    values = torch.randn((kv_heads, capacity, head_dim), generator=generator).to(DEVICE)
    visible = torch.rand((rows, bucket), generator=generator) < 0.7
    visible[:, bucket // 2 :] &= torch.arange(rows)[:, None] % 2 == 0  # odd rows see only the first half
    visible[:, 0] = True
    additive = torch.zeros((rows, bucket)).masked_fill_(~visible, float("-inf")).to(DEVICE)
    out = few_row_attention(q, keys, values, additive, bucket, scale=head_dim**-0.5)
    expected = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], keys[None, :, :bucket], values[None, :, :bucket], attn_mask=additive,
        scale=head_dim**-0.5, enable_gqa=True,
    )[0].transpose(0, 1)  # [rows, heads, head_dim]
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def _inputs(rows: int, heads: int, kv_heads: int, head_dim: int, bucket: int, dtype: torch.dtype) -> tuple[
    torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor
]:
    generator = torch.Generator().manual_seed(rows + bucket)
    q = torch.randn((rows, heads, head_dim), generator=generator).to(DEVICE, dtype)
    keys = torch.randn((kv_heads, bucket + 8, head_dim), generator=generator).to(DEVICE, dtype)
    values = torch.randn((kv_heads, bucket + 8, head_dim), generator=generator).to(DEVICE, dtype)
    visible = torch.ones((rows, bucket), dtype=torch.bool).tril(bucket - rows)
    additive = torch.zeros((rows, bucket)).masked_fill_(~visible, float("-inf")).to(DEVICE, dtype)
    return q, keys, values, additive


# Triton's CPU interpreter keeps bf16 as raw 16-bit integers and feeds them to `tl.dot` unconverted.
@pytest.mark.skipif(DEVICE.type != "cuda", reason="bf16 products: the Triton interpreter multiplies their raw bits")
@pytest.mark.parametrize(("rows", "bucket"), [(16, 200), (16, 600), (33, 1024), (3, 3000)])
def test_one_slice_and_many_slices_match_sdpa_in_bf16(rows: int, bucket: int) -> None:
    """A launch whose keys fit one slice writes its output directly, longer ones combine their slices: both follow
    SDPA in bf16, launch after launch."""
    q, keys, values, additive = _inputs(rows, 9, 3, 64, bucket, torch.bfloat16)
    expected = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], keys[None, :, :bucket], values[None, :, :bucket], attn_mask=additive, scale=0.125,
        enable_gqa=True,
    )[0].transpose(0, 1)
    first = few_row_attention(q, keys, values, additive, bucket, 0.125)
    torch.testing.assert_close(first, expected, rtol=2e-2, atol=2e-2)
    assert torch.equal(few_row_attention(q, keys, values, additive, bucket, 0.125), first)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA graphs")
@pytest.mark.parametrize("bucket", [200, 1500])
def test_attention_in_a_replayed_graph(bucket: int) -> None:
    """Captured in a CUDA graph (one slice, several slices) and replayed over changing inputs, the output follows
    SDPA on every replay."""
    q, keys, values, additive = _inputs(24, 9, 3, 64, bucket, torch.bfloat16)
    few_row_attention(q, keys, values, additive, bucket, 0.125)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = few_row_attention(q, keys, values, additive, bucket, 0.125)
    for step in range(4):
        q.copy_(torch.randn(q.shape, generator=torch.Generator().manual_seed(step)).to(q))
        graph.replay()
        expected = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], keys[None, :, :bucket], values[None, :, :bucket], attn_mask=additive,
            scale=0.125, enable_gqa=True,
        )[0].transpose(0, 1)
        torch.testing.assert_close(out, expected, rtol=2e-2, atol=2e-2)
