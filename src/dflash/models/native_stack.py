"""CPU forwards of a few rows through the native decoder layers (`kernels/cpu_decoder.cpp`).

A one-token step of a small model on a CPU spends about as long in the interpreter between its operations as in
them (about thirty calls per layer). Where a model's layers are the plain Llama / Qwen3 `DecoderLayer` (SiLU MLP,
full attention, optional q/k norms) with `nn.Linear`, `QuantizedLinear` or `QuantizedStack` projections, and a
forward is one the fused CPU operations serve (float32 on the CPU without autograd, into a `KVCache` without
recurrent state, at most `FUSED_ATTENTION_MAX_ROWS` rows, a boolean mask or none; or into the batched core's pool,
every request's rows within that bound: `PackedRows`), `native_layers` runs every decoder layer in one native call. It calls the same compiled functions and torch operations in the same order, so
its results are bitwise the Python layers' (tests compare them); everything else (hybrids, Gemma, tensor
parallelism, long prompt chunks, GPUs) runs the Python layers.

The description of the layers handed to the extension (`DecoderStack`) is a plan kept on the model
(`native_parts.plan_of`: rebuilt after a products change; forward hooks send forwards through the Python layers).
`DFLASH_CPU_NATIVE_LAYERS=0` turns this off.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from dflash.kernels.native_decoder import native_decoder
from dflash.kv.cache import KVCache
from dflash.models.layers import FUSED_ATTENTION_MAX_ROWS, Attention, DecoderLayer, GatedMLP
from dflash.models.native_parts import (
    Plan,
    Unsupported,
    describe_linear,
    describe_norm,
    native_inputs,
    plan_of,
    to_linear,
    to_norm,
)

if TYPE_CHECKING:
    from dflash.kernels.build import DecoderKernel
    from dflash.models.model import CausalLM

__all__ = ["native_layers", "runs_natively"]

PLAN = "_native_plan"


def native_layers(
    model: CausalLM,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    mask: object,
    cache: object,
    capture: Sequence[int],
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """Every decoder layer of `model` over the embedded x [batch, seq, hidden] in one native call, as
    `CausalLM.run_layers` would compute them -> (x, captured features) or None where the Python layers must run."""
    if not native_inputs(x, cos):
        return None
    if type(cache) is KVCache:
        if cache.recurrent is not None or x.shape[1] > FUSED_ATTENTION_MAX_ROWS or not _kernel_mask(mask):
            return None
        packed = None
    else:
        native_rows = getattr(cache, "native_rows", None)  # an attention backend over a pool (the batched core)
        packed = native_rows() if native_rows is not None else None
        if packed is None or mask is not None:
            return None
    plan = _plan(model)
    if not plan.usable or plan.kernel is None:
        return None
    if packed is None:
        assert isinstance(cache, KVCache)
        out, captured = plan.stack.run(x, cos, sin, mask, cache.keys, cache.values, cache.length, list(capture))
    else:
        segments = [plan.kernel.Segment(*segment) for segment in packed.segments]
        out, captured = plan.stack.run_packed(
            x, cos, sin, packed.keys, packed.values, packed.write_slots, segments, list(capture))
    features = torch.cat(captured, dim=-1) if capture else None
    return out, features


def _kernel_mask(mask: object) -> bool:
    """Whether the fused attention takes `mask`: none, or bool [batch or 1, 1, rows, keys]."""
    return mask is None or (
        isinstance(mask, torch.Tensor) and mask.dtype == torch.bool and mask.dim() == 4 and mask.shape[1] == 1
    )


def runs_natively(model: nn.Module) -> bool | None:
    """Whether the model's layers are ones the native call runs; None before a forward has asked."""
    plan: Plan | None = getattr(model, PLAN, None)
    return None if plan is None else plan.stack is not None


def _plan(model: CausalLM) -> Plan:
    return plan_of(model, PLAN, model.layers, lambda: _build(model))


def _build(model: CausalLM) -> tuple[DecoderKernel | None, Any]:
    """The extension and its DecoderStack for the model's layers, or Nones where it does not run them."""
    if model.tensor_parallel is not None or any(model.sliding) or model.rotary_local is not model.rotary:
        return None, None
    kinds: set[str] = set()
    try:
        described = [_describe_layer(layer, kinds) for layer in model.layers]
    except Unsupported:
        return None, None
    kernel = native_decoder(kinds)
    if kernel is None:
        return None, None
    return kernel, kernel.DecoderStack([_layer(kernel, index, parts) for index, parts in enumerate(described)])


def _describe_layer(layer: nn.Module, kinds: set[str]) -> dict[str, Any]:
    if type(layer) is not DecoderLayer:
        raise Unsupported
    attn, mlp = layer.self_attn, layer.mlp
    if type(attn) is not Attention or type(mlp) is not GatedMLP or type(mlp.act) is not nn.SiLU:
        raise Unsupported
    if (attn.q_norm is None) != (attn.k_norm is None):
        raise Unsupported
    return {
        "input_norm": describe_norm(layer.input_layernorm), "post_norm": describe_norm(layer.post_attention_layernorm),
        "q_norm": None if attn.q_norm is None else describe_norm(attn.q_norm),
        "k_norm": None if attn.k_norm is None else describe_norm(attn.k_norm),
        "qkv": describe_linear(attn.qkv_proj, kinds), "o": describe_linear(attn.o_proj, kinds),
        "gate_up": describe_linear(mlp.gate_up_proj, kinds), "down": describe_linear(mlp.down_proj, kinds),
        "heads": attn.num_heads, "kv_heads": attn.num_kv_heads, "head_dim": attn.head_dim, "scale": attn.scale,
    }


def _layer(kernel: DecoderKernel, index: int, parts: dict[str, Any]) -> Any:
    return kernel.Layer(
        index, to_norm(kernel, parts["input_norm"]), to_norm(kernel, parts["post_norm"]),
        to_norm(kernel, parts["q_norm"]), to_norm(kernel, parts["k_norm"]),
        to_linear(kernel, parts["qkv"]), to_linear(kernel, parts["o"]), to_linear(kernel, parts["gate_up"]),
        to_linear(kernel, parts["down"]), parts["heads"], parts["kv_heads"], parts["head_dim"], parts["scale"],
    )
