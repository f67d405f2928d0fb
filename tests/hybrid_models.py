"""A tiny random Qwen3.5 hybrid (3 Gated DeltaNet layers, 1 gated full-attention layer) and our copy of it."""

from __future__ import annotations

from typing import Any

import torch

from dflash.config import ModelConfig
from dflash.models.model import CausalLM
from dflash.models.registry import build_model

TINY_HYBRID: dict[str, Any] = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=12,
    linear_conv_kernel_dim=4,
    max_position_embeddings=512,
    layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
    tie_word_embeddings=False,
)


def hf_tiny_hybrid(seed: int = 0, **overrides: Any) -> Any:
    """transformers' Qwen3_5ForCausalLM with random weights (float32, eager attention). Norm weights and the
    DeltaNet's dt_bias are perturbed so that a (1 + w) / w mix-up or a missing bias shows in the logits, and its
    decays are slow (`_long_memory`)."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.Qwen3_5TextConfig(**{**TINY_HYBRID, **overrides})
    model = transformers.Qwen3_5ForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or "dt_bias" in name:
                param.add_(torch.randn_like(param) * 0.2)
        _long_memory(model)
    return model


def _long_memory(model: Any) -> None:
    """Slow decays (A in 0.02 .. 0.3 instead of up to 16): the state then carries over many tokens, so a state
    that is lost or left wrong changes the tokens that follow."""
    for name, param in model.named_parameters():
        if name.endswith("A_log"):
            param.copy_(torch.empty_like(param).uniform_(0.02, 0.3).log())


def ours_from_hf_hybrid(hf_model: Any) -> CausalLM:
    config = ModelConfig.from_hf(hf_model.config.to_dict())
    return build_model(config, {k: v.detach().clone() for k, v in hf_model.state_dict().items()})


TINY_NEXT: dict[str, Any] = {
    **{k: v for k, v in TINY_HYBRID.items() if k != "layer_types"},
    "layer_types": ["linear_attention", "full_attention", "linear_attention", "linear_attention"],
    "num_experts": 6,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 48,
    "mlp_only_layers": [2],  # one dense MLP among the mixtures
}


def hf_tiny_next(seed: int = 0, **overrides: Any) -> Any:
    """transformers' Qwen3NextForCausalLM with random weights; norms, dt_bias and the router perturbed (the router
    starts at zero, which would tie every expert's score), experts scaled up."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.Qwen3NextConfig(**{**TINY_NEXT, **overrides})
    model = transformers.Qwen3NextForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or "dt_bias" in name:
                param.add_(torch.randn_like(param) * 0.2)
            if name.endswith("mlp.gate.weight"):
                param.copy_(torch.randn_like(param))
            if ".experts." in name:  # large enough that a wrong routing shows in the logits
                param.mul_(10)
        _long_memory(model)
    return model


TINY_35_MOE: dict[str, Any] = {
    **{k: v for k, v in TINY_HYBRID.items() if k not in ("layer_types", "intermediate_size")},
    "layer_types": ["linear_attention", "full_attention", "linear_attention", "linear_attention"],
    "num_experts": 6,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 48,
}


def hf_tiny_35_moe(seed: int = 0, **overrides: Any) -> Any:
    """transformers' Qwen3_5MoeForCausalLM with random weights (every layer a mixture with a shared expert);
    perturbed as `hf_tiny_next`'s (the router starts at zero, which would tie every expert's score)."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.Qwen3_5MoeTextConfig(**{**TINY_35_MOE, **overrides})
    model = transformers.Qwen3_5MoeForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or "dt_bias" in name:
                param.add_(torch.randn_like(param) * 0.2)
            if name.endswith("mlp.gate.weight"):
                param.copy_(torch.randn_like(param))
            if ".experts." in name:  # large enough that a wrong routing shows in the logits
                param.mul_(10)
        _long_memory(model)
    return model
