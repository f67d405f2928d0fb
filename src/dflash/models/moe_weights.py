"""Expert weights of mixture-of-experts checkpoints, brought to one convention.

Checkpoints name experts in three ways:
  * per expert, as on the Hugging Face hub and as transformers 5 still saves them:
    `model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight` ([out, in] each);
  * fused, as transformers 5 holds them in memory: `mlp.experts.gate_up_proj` [experts, 2 * width, hidden]
    (gate rows first) and `mlp.experts.down_proj` [experts, hidden, width];
  * stacked per projection, as llama.cpp stores them (`ffn_{gate,up,down}_exps`).
A `Checkpoint` holds the stacked form: `mlp.experts.gate_proj`, `mlp.experts.up_proj` [experts, width, hidden] and
`mlp.experts.down_proj` [experts, hidden, width] (no `.weight` suffix, as in transformers' fused names), beside the
router `mlp.gate.weight` [experts, hidden]. `stack_expert_weights` converts the other two forms; `join_gate_up`
then gives the model's own layout, gate and up joined per expert (`dflash.models.moe.StackedExperts`), and
`fuse_shared_experts` joins a shared expert's gate and up as a dense MLP's are.
"""

from __future__ import annotations

import re

import torch

from dflash.config import ModelConfig
from dflash.errors import ModelLoadError

__all__ = ["PROJECTIONS", "fuse_shared_experts", "is_expert_tensor", "join_gate_up", "stack_expert_weights"]

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
_EXPERT_TENSOR = re.compile(r"model\.layers\.\d+\.mlp\.experts\.(\d+\.\w+_proj\.weight|\w+_proj)")


def is_expert_tensor(name: str) -> bool:
    """Whether `name` is an expert weight in any of the three forms (loaders keep these for the conversion)."""
    return _EXPERT_TENSOR.fullmatch(name) is not None


def stack_expert_weights(
    config: ModelConfig, weights: dict[str, torch.Tensor], source: object = "checkpoint"
) -> dict[str, torch.Tensor]:
    """`weights` with each sparse layer's experts in the stacked form (per-expert and fused tensors are
    replaced; tensors already stacked stay). Raises `ModelLoadError` when a layer's experts are incomplete."""
    out = dict(weights)
    for layer in range(config.num_layers):
        if not config.sparse_layer(layer):
            continue
        prefix = f"model.layers.{layer}.mlp.experts."
        fused = out.pop(prefix + "gate_up_proj", None)
        if fused is not None:
            if fused.dim() != 3 or fused.shape[1] % 2:
                raise ModelLoadError(f"{source}: {prefix}gate_up_proj has shape {list(fused.shape)}")
            gate, up = fused.chunk(2, dim=1)  # [experts, width, hidden] each
            out.setdefault(prefix + "gate_proj", gate.contiguous())
            out.setdefault(prefix + "up_proj", up.contiguous())
        for projection in PROJECTIONS:
            names = [f"{prefix}{expert}.{projection}.weight" for expert in range(config.num_experts)]
            present = [name for name in names if name in out]
            if not present:
                continue
            if len(present) != len(names):
                missing = next(name for name in names if name not in out)
                raise ModelLoadError(f"{source}: missing tensor {missing!r} ({len(present)} of {len(names)} experts)")
            shapes = {tuple(out[name].shape) for name in names}
            if len(shapes) != 1:
                raise ModelLoadError(f"{source}: the experts of {prefix}*.{projection} differ in shape: {sorted(shapes)}")
            out[prefix + projection] = torch.stack([out.pop(name) for name in names])  # [experts, out, in]
    return out


def join_gate_up(config: ModelConfig, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Stacked `weights` with each sparse layer's `experts.gate_proj` and `experts.up_proj` replaced by their
    concatenation `experts.gate_up_proj` [experts, 2 * width, hidden] (gate rows first); a layer missing either
    keeps what it has (the model then names the missing weight)."""
    out = dict(weights)
    for layer in range(config.num_layers):
        prefix = f"model.layers.{layer}.mlp.experts."
        if prefix + "gate_proj" in out and prefix + "up_proj" in out:
            gate, up = out.pop(prefix + "gate_proj"), out.pop(prefix + "up_proj")
            out[prefix + "gate_up_proj"] = torch.cat((gate, up), dim=1)
    return out


def fuse_shared_experts(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`mlp.shared_expert.gate_proj` and `up_proj` -> the fused `gate_up_proj` of our `GatedMLP` (Qwen3-Next,
    Qwen3.5-MoE)."""
    out = dict(weights)
    for name in [n for n in weights if n.endswith(".mlp.shared_expert.gate_proj.weight")]:
        prefix = name.removesuffix("gate_proj.weight")
        if prefix + "up_proj.weight" in out:
            out[prefix + "gate_up_proj.weight"] = torch.cat((out.pop(name), out.pop(prefix + "up_proj.weight")))
    return out
