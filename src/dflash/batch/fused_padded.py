"""The padded decoding pass through the fused GPU kernels: far fewer graph nodes than the module-by-module pass.

A replayed CUDA graph still pays a few microseconds per kernel, so for small models the step is bound by the kernel
count. Per layer this pass runs add+RMSNorm, the QKV product, one program that normalises q/k, rotates them and
stores k/v straight into the pool's slots (a padding row's slot is -1: nothing stored), attention over the pool
read in place (`dflash.kernels.triton_paged_attention`; DFLASH_PADDED_ATTENTION=gather: the key gather and one
SDPA), the output product, add+RMSNorm, the gate/up product, SiLU*up and the down product
(`dflash.kernels.triton_decode`, `dflash.fastpath.fused_layers.apply_linear`). The same families as the
single-request fused path.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from dflash.batch.padded import PaddedBatch
from dflash.batch.pool import BlockPool
from dflash.fastpath.fused_layers import (
    MLP_REGION,
    Owed,
    add_norm,
    attention_residual_and_mlp,
    embed_rows,
    fused_logits,
    last_product,
    project_and_store,
    supports_fused_layers,
)
from dflash.kernels.triton_paged_attention import paged_attention, paged_attention_usable
from dflash.models.model import CausalLM

__all__ = ["fused_padded_forward", "supports_fused_layers"]


def fused_padded_forward(
    model: CausalLM, pool: BlockPool, batch: PaddedBatch, capture: Sequence[int], *, last_rows: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`padded_forward` for models that `supports_fused_layers` -> (logits [requests, rows, vocab] or with
    `last_rows` [requests, 1, vocab], features [requests, rows, F] or None)."""
    batch.derive()
    config = model.layer_config  # this rank's heads under tensor parallelism
    requests, rows = batch.tokens.shape
    count = requests * rows
    heads, kv_heads, head_dim = config.num_heads, config.num_kv_heads, config.head_dim
    dtype = model.embed_tokens.weight.dtype
    cos, sin = model.rotary.rows_cos_sin(batch.positions.view(-1), dtype)  # [count, head_dim]
    in_place = paged_attention_usable(pool.device, head_dim) and pool.keys.is_contiguous()
    additive = None if in_place else batch.additive_mask(dtype)  # [requests, 1, rows, keys]
    read = batch.read_slots  # [requests, keys]
    wanted = set(capture)
    captured: dict[int, torch.Tensor] = {}
    x = embed_rows(model, batch.tokens.view(1, -1))  # [count, hidden]
    pending: Owed | None = None  # the last MLP output, added inside the next add+RMSNorm
    layer: Any
    for index, layer in enumerate(model.layers):
        attention = layer.self_attn
        h, x = add_norm(x, pending, layer.input_layernorm, MLP_REGION)
        if index - 1 in wanted:
            captured[index - 1] = x
        keys, values = pool.keys[index], pool.values[index]  # [kv_heads, slots, head_dim]
        qkv = project_and_store(layer, h, cos, sin, keys, values, batch.store_slots, config)
        q = qkv[:, : heads * head_dim].view(requests, rows, heads, head_dim).transpose(1, 2)  # [b, heads, rows, hd]
        if additive is None:
            out = paged_attention(q, keys, values, read, batch.past, batch.counts, batch.visibility, attention.scale)
        else:
            out = F.scaled_dot_product_attention(
                q, keys[:, read].transpose(0, 1), values[:, read].transpose(0, 1), attn_mask=additive,
                scale=attention.scale, enable_gqa=heads != kv_heads,
            )  # [requests, heads, rows, head_dim]
        attended = last_product(out.transpose(1, 2).reshape(count, heads * head_dim), attention.o_proj)
        x, pending = attention_residual_and_mlp(layer, x, attended)
    hidden, x = add_norm(x, pending, model.norm, MLP_REGION)
    last = len(model.layers) - 1
    if last in wanted:
        captured[last] = x
    features = torch.cat([captured[i] for i in capture], dim=-1).view(requests, rows, -1) if capture else None
    if last_rows:
        final = batch.last_rows(hidden.view(requests, rows, -1))  # [requests, 1, hidden]
        return fused_logits(model, final.view(requests, -1)).view(requests, 1, -1), features
    return fused_logits(model, hidden).view(requests, rows, -1), features
