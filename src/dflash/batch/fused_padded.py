"""The padded decoding pass through the fused GPU kernels: far fewer graph nodes than the module-by-module pass.

A replayed CUDA graph still pays a few microseconds per kernel, so for small models the step is bound by the kernel
count. Per layer this pass runs add+RMSNorm, the QKV product, one program that normalises q/k, rotates them and
stores k/v straight into the pool's slots (a padding row's slot is -1: nothing stored), attention over the pool
read in place (`dflash.kernels.triton_paged_attention`; DFLASH_PADDED_ATTENTION=gather: the key gather and one
SDPA), the output product, add+RMSNorm, the gate/up product, SiLU*up and the down product
(`dflash.kernels.triton_decode`, `dflash.fastpath.fused_layers.apply_linear`). The same families as the
single-request fused path.

`fused_padded_drafter_forward` is the drafter's block pass the same way (`dflash.fastpath.fused_drafter` for a
batch): each request's new context rows, if any, go through every layer's q/k/v product beside its block rows, and
the store kernel writes their keys and values to their pool slots before the block attends to them, so a drafted
round's context absorption and drafting are one pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dflash.batch.padded import PaddedBatch
from dflash.batch.pool import BlockPool
from dflash.drafter.model import DFlashDrafter
from dflash.fastpath.fused_drafter import FusedDrafterWeights
from dflash.fastpath.fused_layers import (
    MLP_REGION,
    Owed,
    add_norm,
    add_norm_for,
    apply_linear,
    attention_residual_and_mlp,
    embed_rows,
    fused_logits,
    last_product,
    project_and_store,
    supports_fused_layers,
)
from dflash.kernels.triton_decode import add_rms_norm, rope_and_store, silu_and_mul
from dflash.kernels.triton_paged_attention import paged_attention, paged_attention_usable
from dflash.models.int8_linear import Int8Linear
from dflash.models.model import CausalLM

__all__ = ["fused_padded_drafter_forward", "fused_padded_forward", "supports_fused_layers"]


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
        h, x, rounded = add_norm_for(x, pending, layer.input_layernorm, MLP_REGION, attention.qkv_proj)
        if index - 1 in wanted:
            captured[index - 1] = x
        keys, values = pool.keys[index], pool.values[index]  # [kv_heads, slots, head_dim]
        qkv = project_and_store(layer, h, cos, sin, keys, values, batch.store_slots, config, rounded)
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


def fused_padded_drafter_forward(
    drafter: DFlashDrafter, target: CausalLM, pool: BlockPool, weights: FusedDrafterWeights, batch: PaddedBatch,
    context: torch.Tensor | None = None, context_positions: torch.Tensor | None = None,
    context_slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """The drafter's block pass over a loaded batch (each request's block after its context, non-causal inside
    the block; pool slots read in place) -> draft logits [requests, block - 1, vocab] of positions start+1 ...
    `context` [requests, n, n*target_hidden]: new context rows of positions `context_positions` [requests, n],
    stored at `context_slots` [requests * n] (-1: a padding row, nothing stored) before the block attends.
    Drafters that `supports_fused_drafter` (full attention, SiLU) on a pool read in place."""
    batch.derive()
    config = drafter.config
    requests, rows = batch.tokens.shape
    count = requests * rows
    heads, kv_heads, head_dim = config.num_heads, config.num_kv_heads, config.head_dim
    dtype = drafter.fc.weight.dtype
    new = 0 if context is None else context.shape[0] * context.shape[1]
    positions = batch.positions.reshape(-1)  # [count]
    slots = batch.store_slots
    if context is not None:
        assert context_positions is not None and context_slots is not None
        positions = torch.cat((context_positions.reshape(-1), positions))  # [new + count]
        slots = torch.cat((context_slots, slots))
    cos, sin = drafter.rotary.rows_cos_sin(positions, dtype)  # [new + count, head_dim]
    normed = torch.empty((new + count, config.hidden_size), dtype=dtype, device=batch.tokens.device)
    if context is not None:  # the context rows' input to every layer: RMSNorm(fc(features)), as `drafter.context`
        projected = apply_linear(context.reshape(new, -1).to(dtype), drafter.fc)  # [new, hidden]
        add_rms_norm(projected, None, drafter.hidden_norm.weight, drafter.hidden_norm.eps, out=normed[:new])
    x = embed_rows(target, batch.tokens.view(1, -1)).to(dtype)  # [count, hidden]
    pending: torch.Tensor | None = None  # the last MLP output, added inside the next add+RMSNorm
    layer: Any
    for index, layer in enumerate(drafter.layers):
        attention = layer.self_attn
        norm = layer.input_layernorm
        _, x = add_rms_norm(x, pending, norm.weight, norm.eps, out=normed[new:])
        qkv = apply_linear(normed, weights.qkv[index])  # [new + count, (heads + 2 kv_heads) * head_dim]
        keys, values = pool.keys[index], pool.values[index]  # [kv_heads, slots, head_dim]
        rope_and_store(
            qkv, cos, sin, keys, values, slots, num_heads=heads, num_kv_heads=kv_heads,
            q_norm_weight=attention.q_norm.weight, k_norm_weight=attention.k_norm.weight, eps=attention.q_norm.eps,
        )
        q = qkv[new:, : heads * head_dim].view(requests, rows, heads, head_dim).transpose(1, 2)  # [b, heads, rows, hd]
        out = paged_attention(q, keys, values, batch.read_slots, batch.past, batch.counts, batch.visibility,
                              head_dim**-0.5)
        attended = apply_linear(out.transpose(1, 2).reshape(count, heads * head_dim), attention.o_proj)
        post = layer.post_attention_layernorm
        h, x = add_rms_norm(x, attended, post.weight, post.eps)
        pending = apply_linear(silu_and_mul(apply_linear(h, weights.gate_up[index])), layer.mlp.down_proj)
    hidden, _ = add_rms_norm(x, pending, drafter.norm.weight, drafter.norm.eps)  # [count, hidden]
    drafted = hidden.view(requests, rows, -1)[:, 1 : config.block_size].reshape(-1, config.hidden_size)
    head = drafter.draft_head
    if head is None:
        logits = fused_logits(target, drafted)
    elif isinstance(head.rows, (nn.Linear, Int8Linear)):
        logits = head.spread(apply_linear(drafted, head.rows))
    else:
        logits = drafter.project(target, drafted)
    return logits.view(requests, config.block_size - 1, -1)
