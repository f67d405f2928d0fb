"""Warm starts: continue training an existing drafter, optionally grown deeper or wider without changing its output.

Growing keeps the function: new MLP units get random gate/up rows but zero down-projection columns, and new
layers (appended after the existing ones, initialised from the target's layers like a fresh drafter) get zero
output and down projections, so each new residual branch adds exactly zero until training moves it. A DFlash2
drafter keeps its convolutions and selector; its new layers' convolutions start as the identity.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from dflash.drafter.dflash2 import DFlash2Drafter
from dflash.drafter.model import DFlashDrafter
from dflash.models.model import CausalLM
from dflash.training.trainer import init_drafter


def grow_drafter(
    source: DFlashDrafter, target: CausalLM, *, layers: int, intermediate_size: int, seed: int = 0
) -> DFlashDrafter:
    """A float32 drafter with `layers` layers and MLP width `intermediate_size` computing what `source` does."""
    old = source.config
    if layers < old.num_layers or intermediate_size < old.intermediate_size:
        raise ValueError(
            f"a drafter can only grow: {old.num_layers} layers / MLP {old.intermediate_size} -> "
            f"{layers} / {intermediate_size}"
        )
    config = replace(
        old, num_layers=layers, intermediate_size=intermediate_size,
        layer_types=tuple(old.layer_types or ("full_attention",) * old.num_layers)
        + ("full_attention",) * (layers - old.num_layers),
    )
    grown = init_drafter(config, target, from_target_layers=True, seed=seed)
    width = old.intermediate_size
    with torch.no_grad():
        grown.fc.weight.copy_(source.fc.weight.float())
        grown.hidden_norm.weight.copy_(source.hidden_norm.weight.float())
        grown.norm.weight.copy_(source.norm.weight.float())
        new: Any
        mine: Any
        for index, new in enumerate(grown.layers):
            if index >= old.num_layers:  # an appended layer: its residual branches start at zero
                new.self_attn.o_proj.weight.zero_()
                new.mlp.down_proj.weight.zero_()
                continue
            mine = source.layers[index]
            for name in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"):
                getattr(new.self_attn, name).weight.copy_(getattr(mine.self_attn, name).weight.float())
            new.input_layernorm.weight.copy_(mine.input_layernorm.weight.float())
            new.post_attention_layernorm.weight.copy_(mine.post_attention_layernorm.weight.float())
            new.mlp.gate_proj.weight[:width].copy_(mine.mlp.gate_proj.weight.float())
            new.mlp.up_proj.weight[:width].copy_(mine.mlp.up_proj.weight.float())
            new.mlp.down_proj.weight.zero_()
            new.mlp.down_proj.weight[:, :width].copy_(mine.mlp.down_proj.weight.float())
            if isinstance(source, DFlash2Drafter):
                new.attention_conv.load_state_dict(mine.attention_conv.state_dict())
                new.mlp_conv.load_state_dict(mine.mlp_conv.state_dict())
        if isinstance(source, DFlash2Drafter) and isinstance(grown, DFlash2Drafter):
            # appended layers keep identity convolutions, which pass their zero branches on as zero
            grown.candidate_selector.load_state_dict(source.candidate_selector.state_dict())
    return grown
