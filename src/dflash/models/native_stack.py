"""CPU forwards of a few rows through the native decoder layers (`kernels/cpu_decoder.cpp`).

A one-token step of a small model on a CPU spends about as long in the interpreter between its operations as in
them (about thirty calls per layer). Where a model's layers are the plain Llama / Qwen3 `DecoderLayer` (SiLU MLP,
full attention, optional q/k norms) with `nn.Linear`, `QuantizedLinear` or `QuantizedStack` projections, and a
forward is one the fused CPU operations serve (float32 on the CPU without autograd, into a `KVCache` without
recurrent state, at most `FUSED_ATTENTION_MAX_ROWS` rows, a boolean mask or none; or into the batched core's pool,
every request's rows within that bound: `PackedRows`), `native_layers` runs every decoder layer in one native call. It calls the same compiled functions and torch operations in the same order, so
its results are bitwise the Python layers' (tests compare them); everything else (hybrids, Gemma, tensor
parallelism, long prompt chunks, GPUs) runs the Python layers.

The description of the layers handed to the extension (`DecoderStack`) is built at a model's first such forward
and kept on the model; it is built again after any `QuantizedLinear.use_products` (the products kind is part of
it). Forward hooks on the layers' modules (or global ones) send the forward through the Python layers, where they
fire. `DFLASH_CPU_NATIVE_LAYERS=0` turns this off.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from dflash import environment
from dflash.kernels.native_decoder import native_decoder
from dflash.kv.cache import KVCache
from dflash.models.layers import FUSED_ATTENTION_MAX_ROWS, Attention, DecoderLayer, GatedMLP, RMSNorm
from dflash.models.quantized_layers import QuantizedLinear, QuantizedStack

if TYPE_CHECKING:
    from dflash.kernels.build import DecoderKernel
    from dflash.models.model import CausalLM

__all__ = ["native_layers", "runs_natively"]

# QuantizedLinear.products -> (the extension that computes it, the kind code of cpu_decoder.cpp)
PRODUCT_KINDS = {"float32": ("float32", 1), "amx": ("amx", 2), "int8": ("int8", 3), "int8x2": ("int8", 4)}
DENSE_KIND = 0


@dataclass(frozen=True)
class _Plan:
    stack: Any  # the extension's DecoderStack, or None where the model's layers are not ones it runs
    kernel: DecoderKernel | None
    generation: int  # QuantizedLinear.products_changes when it was built
    hooks: tuple[dict[Any, Any], ...]  # the layers' modules' forward (pre-)hook tables: hooks must see the modules run


class _Unsupported(Exception):
    """A module the native layers do not run."""


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
    if x.device.type != "cpu" or x.dtype != torch.float32 or torch.is_grad_enabled():
        return None
    if not environment.cpu_native_layers_enabled() or not environment.cpu_layer_ops_enabled():
        return None
    if cos.dtype != torch.float32 or cos.dim() != 4 or cos.shape[1] != 1:
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
    plan = _plan_of(model)
    if plan.stack is None or plan.kernel is None or any(plan.hooks) or _global_hooks():
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


def runs_natively(model: CausalLM) -> bool | None:
    """Whether the model's layers are ones the native call runs; None before a forward has asked."""
    plan: _Plan | None = getattr(model, "_native_plan", None)
    return None if plan is None else plan.stack is not None


def _plan_of(model: CausalLM) -> _Plan:
    plan: _Plan | None = getattr(model, "_native_plan", None)
    if plan is None or plan.generation != QuantizedLinear.products_changes:
        modules = list(model.layers.modules())
        hooks = tuple(table for m in modules for table in (m._forward_hooks, m._forward_pre_hooks))
        kernel, stack = _build(model)
        plan = _Plan(stack, kernel, QuantizedLinear.products_changes, hooks)
        model._native_plan = plan  # type: ignore[assignment]  # kept on the model, out of its modules
    return plan


def _global_hooks() -> bool:
    return bool(nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks)


def _build(model: CausalLM) -> tuple[DecoderKernel | None, Any]:
    """The extension and its DecoderStack for the model's layers, or Nones where it does not run them."""
    if model.tensor_parallel is not None or any(model.sliding) or model.rotary_local is not model.rotary:
        return None, None
    kinds: set[str] = set()
    try:
        described = [_describe_layer(layer, kinds) for layer in model.layers]
    except _Unsupported:
        return None, None
    kernel = native_decoder(kinds)
    if kernel is None:
        return None, None
    return kernel, kernel.DecoderStack([_layer(kernel, index, parts) for index, parts in enumerate(described)])


def _describe_layer(layer: nn.Module, kinds: set[str]) -> dict[str, Any]:
    if type(layer) is not DecoderLayer:
        raise _Unsupported
    attn, mlp = layer.self_attn, layer.mlp
    if type(attn) is not Attention or type(mlp) is not GatedMLP or type(mlp.act) is not nn.SiLU:
        raise _Unsupported
    if (attn.q_norm is None) != (attn.k_norm is None):
        raise _Unsupported
    return {
        "input_norm": _norm(layer.input_layernorm), "post_norm": _norm(layer.post_attention_layernorm),
        "q_norm": None if attn.q_norm is None else _norm(attn.q_norm),
        "k_norm": None if attn.k_norm is None else _norm(attn.k_norm),
        "qkv": _linear(attn.qkv_proj, kinds), "o": _linear(attn.o_proj, kinds),
        "gate_up": _linear(mlp.gate_up_proj, kinds), "down": _linear(mlp.down_proj, kinds),
        "heads": attn.num_heads, "kv_heads": attn.num_kv_heads, "head_dim": attn.head_dim, "scale": attn.scale,
    }


def _norm(module: nn.Module) -> tuple[torch.Tensor, float, bool]:
    if type(module) is not RMSNorm or module.weight.dtype != torch.float32:
        raise _Unsupported
    return module.weight, float(module.eps), bool(module.adds_one)


def _linear(module: nn.Module, kinds: set[str]) -> dict[str, Any]:
    """A projection as products (kind, weights, qtype, out), its bias, whether stacked and its input width."""
    if type(module) is nn.Linear:
        if module.weight.dtype != torch.float32:
            raise _Unsupported
        return {"parts": [(DENSE_KIND, module.weight, 0, module.out_features)], "bias": module.bias,
                "stacked": False, "in": module.in_features}
    if type(module) is QuantizedLinear:
        return {"parts": [_product(module, kinds)], "bias": module.bias, "stacked": False, "in": module.in_features}
    if type(module) is QuantizedStack:
        parts = []
        for part in module.parts:
            if type(part) is not QuantizedLinear or part.bias is not None:
                raise _Unsupported
            parts.append(_product(part, kinds))
        return {"parts": parts, "bias": module.bias, "stacked": True, "in": module.in_features}
    raise _Unsupported


def _product(module: QuantizedLinear, kinds: set[str]) -> tuple[int, torch.Tensor, int, int]:
    if module.products not in PRODUCT_KINDS:
        raise _Unsupported
    extension, code = PRODUCT_KINDS[module.products]
    kinds.add(extension)
    return code, module.blocks, module.qtype, module.out_features


def _layer(kernel: DecoderKernel, index: int, parts: dict[str, Any]) -> Any:
    def norm(described: tuple[torch.Tensor, float, bool] | None) -> Any:
        return None if described is None else kernel.Norm(*described)

    def linear(described: dict[str, Any]) -> Any:
        products = [kernel.Product(*product) for product in described["parts"]]
        return kernel.Linear(products, described["bias"], described["stacked"], described["in"])

    return kernel.Layer(
        index, norm(parts["input_norm"]), norm(parts["post_norm"]), norm(parts["q_norm"]), norm(parts["k_norm"]),
        linear(parts["qkv"]), linear(parts["o"]), linear(parts["gate_up"]), linear(parts["down"]),
        parts["heads"], parts["kv_heads"], parts["head_dim"], parts["scale"],
    )
