"""A DFlash drafter's layers in one native call on the CPU (`kernels/drafter_stack.h`), bitwise the Python layers.

A drafter round on a CPU runs its four-odd layers twice over: once to take the new context rows into its cache
(`DFlashDrafter.absorb_context`) and once over the block (`draft_hidden`), about thirty interpreter calls per layer
each time. Where the drafter is a plain `DFlashDrafter` whose layers have their joined projections
(`fuse_projections`: the CPU's Q8_0 drafter), SiLU MLPs and full attention only, and the tensors are float32 on the
CPU without autograd, `native_absorb` and `native_block` run those loops in one call each: the same compiled
products and fused operations, the same torch operations, in the same order (tests compare every output and cache
slot). Otherwise (a DFlash2 drafter, sliding-window layers, masks, GPUs, training) the Python loops run. The plan
is kept on the drafter (`dflash.models.native_parts.plan_of`); `DFLASH_CPU_NATIVE_LAYERS=0` turns this off.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from dflash.kernels.native_decoder import native_decoder
from dflash.kv.cache import KVCache
from dflash.models import native_parts as parts
from dflash.models.layers import FUSED_ATTENTION_MAX_ROWS

if TYPE_CHECKING:
    from dflash.drafter.model import DFlashDrafter
    from dflash.kernels.build import DecoderKernel

__all__ = ["drafter_runs_natively", "native_absorb", "native_block"]

PLAN = "_native_plan"


def native_absorb(drafter: DFlashDrafter, ctx: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache) -> bool:
    """absorb_context's loop over the layers: every layer's keys and values of the context rows ctx [batch, rows,
    hidden] into `cache` after its `length` slots (not advanced here). False where the Python loop must run."""
    plan = _plan_for(drafter, ctx, cos, cache)
    if plan is None:
        return False
    plan.stack.absorb(ctx, cos, sin, cache.keys, cache.values, cache.length)
    return True


def native_block(
    drafter: DFlashDrafter, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache, first: int,
    masks: dict[bool, torch.Tensor | None], outputs: slice | None,
) -> torch.Tensor | None:
    """draft_hidden's loop over the layers: the block x [batch, block, hidden] over the context slots [first,
    cache.length), its keys and values in the free slots after them -> x after the last layer ([batch, len(outputs),
    hidden] where `outputs` picks rows), before the final norm; None where the Python loop must run."""
    if any(mask is not None for mask in masks.values()) or x.shape[1] > FUSED_ATTENTION_MAX_ROWS:
        return None
    if outputs is not None and (outputs.step not in (None, 1) or outputs.start is None or outputs.stop is None
                                or outputs.start < 0 or outputs.stop < 0):
        return None
    plan = _plan_for(drafter, x, cos, cache)
    if plan is None:
        return None
    q_start, q_stop = (-1, -1) if outputs is None else (outputs.start, outputs.stop)
    out: torch.Tensor = plan.stack.block(x, cos, sin, cache.keys, cache.values, first, cache.length, q_start, q_stop)
    return out


def _plan_for(drafter: DFlashDrafter, x: torch.Tensor, cos: torch.Tensor, cache: object) -> parts.Plan | None:
    if not parts.native_inputs(x, cos) or type(cache) is not KVCache or cache.recurrent is not None:
        return None
    plan = parts.plan_of(drafter, PLAN, drafter.layers, lambda: _build(drafter))
    return plan if plan.usable else None


def _build(drafter: DFlashDrafter) -> tuple[DecoderKernel | None, Any]:
    from dflash.drafter.model import DFlashDrafter, DrafterAttention, DrafterLayer, DrafterMLP

    if type(drafter) is not DFlashDrafter or any(drafter.sliding):
        return None, None
    kinds: set[str] = set()
    described: list[tuple[list[tuple[torch.Tensor, float, bool]], list[dict[str, Any]], tuple[int, int, int]]] = []
    try:
        for layer in drafter.layers:
            if type(layer) is not DrafterLayer:
                raise parts.Unsupported
            attn, mlp = layer.self_attn, layer.mlp
            if type(attn) is not DrafterAttention or type(mlp) is not DrafterMLP or not mlp.silu:
                raise parts.Unsupported
            if attn.qkv_proj is None or attn.kv_proj is None or mlp.gate_up_proj is None:
                raise parts.Unsupported  # the Python layers' unjoined path makes other calls
            norms = [parts.describe_norm(m) for m in (layer.input_layernorm, layer.post_attention_layernorm,
                                                attn.q_norm, attn.k_norm)]
            linears = [parts.describe_linear(m, kinds) for m in (attn.qkv_proj, attn.kv_proj, attn.o_proj,
                                                           mlp.gate_up_proj, mlp.down_proj)]
            described.append((norms, linears, (attn.num_heads, attn.num_kv_heads, attn.head_dim)))
    except parts.Unsupported:
        return None, None
    kernel = native_decoder(kinds)
    if kernel is None:
        return None, None
    layers = [
        kernel.DrafterLayer(index, *(parts.to_norm(kernel, n) for n in norms),
                            *(parts.to_linear(kernel, lin) for lin in linears), *heads)
        for index, (norms, linears, heads) in enumerate(described)
    ]
    return kernel, kernel.DrafterStack(layers)


def drafter_runs_natively(drafter: nn.Module) -> bool | None:
    """Whether the drafter's layers are ones the native calls run; None before a round has asked."""
    plan: parts.Plan | None = getattr(drafter, PLAN, None)
    return None if plan is None else plan.stack is not None
