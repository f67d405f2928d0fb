"""Tiny random transformers models of each supported family, for parity tests against our runtime."""

from __future__ import annotations

from typing import Any

import torch

from dflash.config import ModelConfig
from dflash.models.model import CausalLM
from dflash.models.registry import build_model

TINY_COMMON = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
)


def hf_tiny(family: str, seed: int = 0, attention_bias: bool = False) -> torch.nn.Module:
    """A transformers model with random weights (float32, eager attention); `attention_bias`: biases on every
    attention projection, drawn at random (transformers starts them at zero)."""
    import transformers

    torch.manual_seed(seed)
    common: dict[str, Any] = {**TINY_COMMON, "attention_bias": attention_bias}
    if family == "llama":
        cfg = transformers.LlamaConfig(**common, rope_theta=10000.0, tie_word_embeddings=True)
        cls = transformers.LlamaForCausalLM
    elif family == "qwen3":
        cfg = transformers.Qwen3Config(**common, rope_theta=10000.0, tie_word_embeddings=False)
        cls = transformers.Qwen3ForCausalLM
    elif family == "gemma3":
        cfg = transformers.Gemma3TextConfig(
            **common,
            sliding_window=16,
            query_pre_attn_scalar=16,
            rope_theta=1_000_000.0,
            rope_local_base_freq=10000.0,
            layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        )
        cls = transformers.Gemma3ForCausalLM
    else:
        raise ValueError(family)
    model = cls(cfg).eval()
    with torch.no_grad():  # HF initialises norms to 1 (or 0 for gemma): randomise them so wrong norms show
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.add_(torch.randn_like(param) * 0.1)
    return model


def ours_from_hf(hf_model: torch.nn.Module) -> CausalLM:
    config = ModelConfig.from_hf(hf_model.config.to_dict())
    weights = {k: v.detach().clone() for k, v in hf_model.state_dict().items()}
    return build_model(config, weights)
