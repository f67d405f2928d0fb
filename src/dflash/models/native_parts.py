"""What the native layers of a target (`native_stack`) and of a drafter (`dflash.drafter.native_drafter`) share:
describing projections and norms for the extension (`kernels/cpu_decoder.cpp`), and the plan kept on a model.

A plan is the extension's description of a model's layers, built at the model's first forward the native call could
take and kept on the model (out of its modules). It is built again after any `QuantizedLinear.use_products` (the
products kind is part of it) or `layers_changed()` (what replaces modules calls it: quantizing a drafter, joining its
projections), and a copy of a model (`copy.deepcopy`) builds its own. Forward hooks on the described modules, or
global ones, send forwards through the Python layers, where they fire.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from dflash import environment
from dflash.kernels.build import DecoderKernel
from dflash.models.layers import RMSNorm

if TYPE_CHECKING:
    from dflash.models.quantized_layers import QuantizedLinear

__all__ = [
    "Plan", "Unsupported", "describe_linear", "describe_norm", "layers_changed", "native_inputs", "plan_of",
    "to_linear", "to_norm",
]

# QuantizedLinear.products -> (the extension that computes it, the kind code of cpu_decoder.cpp)
PRODUCT_KINDS = {"float32": ("float32", 1), "amx": ("amx", 2), "int8": ("int8", 3), "int8x2": ("int8", 4)}
DENSE_KIND = 0
PANEL_CODE_OFFSET = 2  # int8 3 -> 5, int8x2 4 -> 6 (`native_layers.h`: kPanels, kPanelsx2)

_layer_changes = 0  # `layers_changed` calls


class Unsupported(Exception):
    """A module the native layers do not run."""


@dataclass(frozen=True)
class Plan:
    stack: Any  # the extension's stack, or None where the model's layers are not ones it runs
    kernel: DecoderKernel | None
    generation: tuple[int, int]  # (QuantizedLinear.products_changes, layers_changed calls) when it was built
    hooks: tuple[dict[Any, Any], ...]  # the described modules' forward (pre-)hook tables

    def __deepcopy__(self, memo: dict[int, Any]) -> None:
        return None  # the copy's modules are new: it builds its own plan

    @property
    def usable(self) -> bool:
        """Whether a forward may take the native call now (a stack, and no hook that must see the modules run)."""
        return self.stack is not None and not any(self.hooks) and not _global_hooks()


def layers_changed() -> None:
    """Modules of some model's layers were replaced: every plan is built again at its next forward."""
    global _layer_changes
    _layer_changes += 1


def native_inputs(x: torch.Tensor, cos: torch.Tensor) -> bool:
    """Whether a forward over x with these rotary angles may go native: float32 on the CPU without autograd, cos
    [batch or 1, 1, rows, head_dim] float32 (the fused rotation's layout), and `DFLASH_CPU_NATIVE_LAYERS` and
    `DFLASH_CPU_LAYER_OPS` both on (the native layers call the fused kernels)."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or torch.is_grad_enabled():
        return False
    if cos.dtype != torch.float32 or cos.dim() != 4 or cos.shape[1] != 1:
        return False
    return environment.cpu_native_layers_enabled() and environment.cpu_layer_ops_enabled()


def plan_of(owner: nn.Module, attribute: str, modules: nn.Module,
            build: Callable[[], tuple[DecoderKernel | None, Any]]) -> Plan:
    """The plan kept on `owner` under `attribute`, (re)built by `build` where missing or stale; `modules`: the ones
    it describes (their hooks are watched)."""
    plan: Plan | None = getattr(owner, attribute, None)
    quantized = _quantized_layers()
    generation = (0 if quantized is None else quantized.QuantizedLinear.products_changes, _layer_changes)
    if plan is None or plan.generation != generation:
        hooks = tuple(table for m in modules.modules() for table in (m._forward_hooks, m._forward_pre_hooks))
        kernel, stack = build()
        plan = Plan(stack, kernel, generation, hooks)
        object.__setattr__(owner, attribute, plan)  # not a module, not a buffer: out of the state dict
    return plan


def _quantized_layers() -> Any:
    """`dflash.models.quantized_layers` where it is loaded, else None (then no module is one of its kinds). Not
    imported here: it needs gguf, which dense models (the GPU's random-weight studies) do without."""
    return sys.modules.get("dflash.models.quantized_layers")


def _global_hooks() -> bool:
    return bool(nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks)


def describe_norm(module: nn.Module) -> tuple[torch.Tensor, float, bool]:
    """An RMSNorm as (weight, eps, adds_one)."""
    if type(module) is not RMSNorm or module.weight.dtype != torch.float32:
        raise Unsupported
    return module.weight, float(module.eps), bool(module.adds_one)


def describe_linear(module: nn.Module | None, kinds: set[str]) -> dict[str, Any]:
    """A projection as products (kind, weights, qtype, out), its bias, whether stacked and its input width; the
    products extensions it needs are added to `kinds`."""
    if type(module) is nn.Linear:
        if module.weight.dtype != torch.float32:
            raise Unsupported
        return {"parts": [(DENSE_KIND, module.weight, 0, module.out_features)], "bias": module.bias,
                "stacked": False, "in": module.in_features}
    quantized = _quantized_layers()
    if quantized is None:
        raise Unsupported
    described: Any = module  # one of the quantized kinds, checked by exact type
    if type(described) is quantized.QuantizedLinear:
        return {"parts": [_product(described, kinds)], "bias": described.bias, "stacked": False,
                "in": described.in_features}
    if type(described) is quantized.QuantizedStack:
        parts = []
        for part in described.parts:
            if type(part) is not quantized.QuantizedLinear or part.bias is not None:
                raise Unsupported
            parts.append(_product(part, kinds))
        return {"parts": parts, "bias": described.bias, "stacked": True, "in": described.in_features}
    raise Unsupported


def _product(module: QuantizedLinear, kinds: set[str]) -> tuple[int, torch.Tensor, int, int]:
    if module.products not in PRODUCT_KINDS:
        raise Unsupported
    extension, code = PRODUCT_KINDS[module.products]
    kinds.add(extension)
    if module.panels:  # the int8 kinds' codes on weight panels: 5 (one part), 6 (two)
        code += PANEL_CODE_OFFSET
    return code, module.blocks, module.qtype, module.out_features


def to_norm(kernel: DecoderKernel, described: tuple[torch.Tensor, float, bool] | None) -> Any:
    return None if described is None else kernel.Norm(*described)


def to_linear(kernel: DecoderKernel, described: dict[str, Any]) -> Any:
    products = [kernel.Product(*product) for product in described["parts"]]
    return kernel.Linear(products, described["bias"], described["stacked"], described["in"])
