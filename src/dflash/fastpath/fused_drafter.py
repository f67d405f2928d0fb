"""The drafter round with fused element-wise kernels (`dflash.kernels.triton_decode`).

Same inputs, outputs and cache writes as `static_drafter_hidden` then `project`, for drafters whose layers all
attend fully (no sliding window) with SiLU MLPs. The new context rows and the block rows go through each layer's q/k/v product
together ([2B, hidden]); the kernel stores the context rows' K/V at their positions (scratch rows past the real
ones store nothing) and the block's K/V in the slots right after the context, which attention then reads as one
range: every committed position and the whole block, as in the eager round. The block's rows attend through the
split-key program (`dflash.kernels.triton_attention`) unless DFLASH_ATTENTION=sdpa: with SDPA a 16-row block's
attention grows with the context several times faster than the program's (`benchmarks/gpu_attention_rows.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dflash.drafter.model import DFlashDrafter, TargetHeads
from dflash.fastpath.fused_layers import apply_linear, embed_rows, fused_logits, split_key_attention
from dflash.kernels.triton_attention import attention_kernel_usable, few_row_attention
from dflash.kernels.triton_decode import add_rms_norm, rope_and_store, silu_and_mul, triton_available
from dflash.kv.cache import KVCache
from dflash.models.int8_linear import Int8Linear


def supports_fused_drafter(drafter: DFlashDrafter) -> bool:
    """Whether the fused round serves `drafter` (not a DFlash2 drafter: its block convolutions are not fused)."""
    from dflash.drafter.dflash2 import DFlash2Drafter

    head_dim = drafter.config.head_dim
    return (
        not isinstance(drafter, DFlash2Drafter)
        and triton_available()
        and not any(drafter.sliding)
        and drafter.config.hidden_act == "silu"
        and head_dim & (head_dim - 1) == 0
        and all(_joinable(layer) for layer in drafter.layers)
    )


def _joinable(layer: Any) -> bool:
    """Whether a layer's q/k/v and gate/up products can be joined (bias-free, all dense or all int8)."""
    groups = (
        (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj),
        (layer.mlp.gate_proj, layer.mlp.up_proj),
    )
    return all(
        all(getattr(part, "bias", None) is None for part in parts)
        and (all(isinstance(part, Int8Linear) for part in parts) or all(type(part) is nn.Linear for part in parts))
        for parts in groups
    )


@dataclass
class FusedDrafterWeights:
    qkv: list[nn.Module]  # per layer: a product to [(heads + 2 kv_heads) * head_dim] (nn.Linear or Int8Linear)
    gate_up: list[nn.Module]  # per layer: a product to [2 * intermediate]


def fuse_drafter_weights(drafter: DFlashDrafter) -> FusedDrafterWeights:
    """Join each layer's q/k/v and gate/up products into one module each, and make the separate modules' weights
    views of the joined ones (no second copy; the eager path keeps working on the same memory). Dense and int8
    (`Int8Linear`) layers both join."""
    fused = FusedDrafterWeights([], [])
    layer: Any
    for layer in drafter.layers:
        attention, mlp = layer.self_attn, layer.mlp
        fused.qkv.append(_joined([attention.q_proj, attention.k_proj, attention.v_proj]))
        fused.gate_up.append(_joined([mlp.gate_proj, mlp.up_proj]))
    return fused


def _joined(parts: list[Any]) -> nn.Module:
    """One module over `parts` (what `_joinable` admits: bias-free, all `nn.Linear` or all `Int8Linear`)."""
    if isinstance(parts[0], Int8Linear):
        return Int8Linear.stacked(parts)
    weight = torch.cat([linear.weight.detach() for linear in parts])  # [sum of outs, in]
    offset = 0
    for linear in parts:
        rows = linear.weight.shape[0]
        linear.weight = nn.Parameter(weight[offset : offset + rows], requires_grad=False)
        offset += rows
    joined = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    joined.weight = nn.Parameter(weight, requires_grad=False)
    return joined


def _round_setup(
    drafter: DFlashDrafter, storage: KVCache, start: torch.Tensor, new_rows: torch.Tensor, block: int, bucket: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The round's slots [2B] (context rows, -1 for scratch ones, then block rows; the context positions written into
    `storage`), additive mask row [bucket] (committed slots and the block visible) and rotary cos, sin [2B,
    head_dim]: one program where the rotary table is prepared (`dflash.kernels.triton_round_setup`)."""
    dtype = drafter.fc.weight.dtype
    device = start.device
    table = drafter.rotary.table(dtype, device)
    if table is not None:
        from dflash.kernels.triton_round_setup import drafter_setup

        return drafter_setup(start, new_rows, block, storage.positions[0], table, bucket, dtype)
    offsets = torch.arange(block, device=device)
    context_positions = start - new_rows + offsets  # [B]
    storage.positions[0].index_copy_(0, context_positions, context_positions)
    block_positions = start + offsets  # [B]
    slots = torch.cat((torch.where(offsets < new_rows, context_positions, -1), block_positions))  # [2B]
    cos, sin = drafter.rotary.rows_cos_sin(torch.cat((context_positions, block_positions)), dtype)  # [2B, head_dim]
    visible = torch.arange(bucket, device=device) < start + block  # [bucket]: committed slots and the block
    return slots, torch.where(visible, 0.0, float("-inf")).to(dtype), cos, sin


def fused_drafter_round(
    drafter: DFlashDrafter,
    target: TargetHeads,
    storage: KVCache,
    weights: FusedDrafterWeights,
    block_ids: torch.Tensor,
    start: torch.Tensor,
    new_rows: torch.Tensor,
    new_features: torch.Tensor,
    *,
    bucket: int,
    drafts: int,
) -> torch.Tensor:
    """Arguments as `static_drafter_hidden`; `bucket` must cover start + B. -> logits [drafts, vocab]."""
    config = drafter.config
    block = block_ids.shape[1]
    heads, kv_heads, head_dim = config.num_heads, config.num_kv_heads, config.head_dim
    dtype = drafter.fc.weight.dtype
    device = block_ids.device
    slots, additive_row, cos, sin = _round_setup(drafter, storage, start, new_rows, block, bucket)
    additive = additive_row.expand(1, 1, block, bucket)
    split_keys = split_key_attention(block) and storage.keys.is_contiguous() and attention_kernel_usable(head_dim)
    rows = torch.empty((2 * block, config.hidden_size), dtype=dtype, device=device)  # [context rows; block rows]
    add_rms_norm(
        apply_linear(new_features[0].to(dtype).contiguous(), drafter.fc), None, drafter.hidden_norm.weight,
        drafter.hidden_norm.eps, out=rows[:block],
    )
    x = embed_rows(target, block_ids).to(dtype)  # [B, hidden]
    pending: torch.Tensor | None = None
    layer: Any
    for index, layer in enumerate(drafter.layers):
        attention = layer.self_attn
        _, x = add_rms_norm(x, pending, layer.input_layernorm.weight, layer.input_layernorm.eps, out=rows[block:])
        qkv = apply_linear(rows, weights.qkv[index])  # [2B, (heads + 2 kv_heads) * head_dim]
        rope_and_store(
            qkv, cos, sin, storage.keys[index, 0], storage.values[index, 0], slots, num_heads=heads,
            num_kv_heads=kv_heads, q_norm_weight=attention.q_norm.weight, k_norm_weight=attention.k_norm.weight,
            eps=attention.q_norm.eps,
        )
        q = qkv[block:, : heads * head_dim].view(block, heads, head_dim)  # [B, heads, head_dim]
        if split_keys:
            out = few_row_attention(
                q, storage.keys[index, 0], storage.values[index, 0], additive[0, 0], bucket, head_dim**-0.5
            )  # [B, heads, head_dim]
        else:
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1)[None], storage.keys[index, :, :, :bucket], storage.values[index, :, :, :bucket],
                attn_mask=additive, enable_gqa=heads != kv_heads,
            )[0].transpose(0, 1)  # [B, heads, head_dim]
        attended = apply_linear(out.reshape(block, heads * head_dim), attention.o_proj)
        h, x = add_rms_norm(x, attended, layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps)
        pending = apply_linear(silu_and_mul(apply_linear(h, weights.gate_up[index])), layer.mlp.down_proj)
    hidden, _ = add_rms_norm(x, pending, drafter.norm.weight, drafter.norm.eps)
    head = drafter.draft_head
    if head is None:
        return fused_logits(target, hidden[1 : 1 + drafts])  # [drafts, vocab]
    if isinstance(head.rows, (nn.Linear, Int8Linear)):
        return head.spread(apply_linear(hidden[1 : 1 + drafts], head.rows))  # [drafts, vocab]
    return drafter.project(target, hidden[1 : 1 + drafts])
