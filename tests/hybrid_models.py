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
    DeltaNet's dt_bias are perturbed so that a (1 + w) / w mix-up or a missing bias shows in the logits."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.Qwen3_5TextConfig(**{**TINY_HYBRID, **overrides})
    model = transformers.Qwen3_5ForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or "dt_bias" in name:
                param.add_(torch.randn_like(param) * 0.2)
    return model


def ours_from_hf_hybrid(hf_model: Any) -> CausalLM:
    config = ModelConfig.from_hf(hf_model.config.to_dict())
    return build_model(config, {k: v.detach().clone() for k, v in hf_model.state_dict().items()})
