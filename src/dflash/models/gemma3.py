"""Gemma 3 family: sandwich norms around attention and MLP, (1 + w) RMSNorm, GELU-tanh, scaled embeddings,
interleaved sliding-window layers with their own RoPE base. The shared attention handles q/k norm and scale."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from dflash.config import ModelConfig
from dflash.kv.cache import AttentionBackend, CacheWriter
from dflash.models.layers import Attention, AttentionMask, GatedMLP, RMSNorm
from dflash.models.model import CausalLM


class Gemma3DecoderLayer(nn.Module):
    """x + post_attn_norm(attn(input_norm(x))), then x + post_ffw_norm(mlp(pre_ffw_norm(x)))."""

    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        dim, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Attention(config, layer_index)
        self.mlp = GatedMLP(dim, config.intermediate_size, config.hidden_act)
        self.input_layernorm = RMSNorm(dim, eps, adds_one=True)
        self.post_attention_layernorm = RMSNorm(dim, eps, adds_one=True)
        self.pre_feedforward_layernorm = RMSNorm(dim, eps, adds_one=True)
        self.post_feedforward_layernorm = RMSNorm(dim, eps, adds_one=True)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: AttentionMask,
        cache: CacheWriter | AttentionBackend | None,
    ) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, mask, cache))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3ForCausalLM(CausalLM):
    layer_class: ClassVar[type[nn.Module]] = Gemma3DecoderLayer
