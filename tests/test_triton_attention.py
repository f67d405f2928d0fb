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
