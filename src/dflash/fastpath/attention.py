"""Masked grouped-query attention as equal-head attention, so the fused SDPA kernels take it.

With an explicit mask and fewer key/value heads than query heads, SDPA's flash kernel refuses the mask and the
memory-efficient kernel refuses unequal head counts, so the call falls back to the unfused math path (which also
copies K/V once per query group). Folding each group's query heads into the row dimension, `[1, heads, rows, d]` ->
`[1, kv_heads, group * rows, d]`, gives one query block per key/value head: the same attention, equal head counts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def grouped_mask(additive: torch.Tensor, group: int) -> torch.Tensor:
    """additive: [1, 1, rows, keys] -> [1, 1, group * rows, keys] (the mask of every folded query head)."""
    _, _, rows, keys = additive.shape
    return additive[:, :, None].expand(1, 1, group, rows, keys).reshape(1, 1, group * rows, keys)


def grouped_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """q: [1, heads, rows, d]; k, v: [1, kv_heads, keys, d]; mask: `grouped_mask` of the [1, 1, rows, keys] additive
    mask -> [1, heads, rows, d]."""
    _, heads, rows, head_dim = q.shape
    kv_heads = k.shape[1]
    folded = q.reshape(1, kv_heads, (heads // kv_heads) * rows, head_dim)  # query head h = kv * group + g
    out = F.scaled_dot_product_attention(folded, k, v, attn_mask=mask, scale=scale)
    return out.reshape(1, heads, rows, head_dim)
