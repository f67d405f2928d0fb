"""Qwen3-MoE family (Qwen3-30B-A3B, Qwen3-Coder-30B-A3B): Qwen3 attention, with the dense MLP replaced by a sparse
mixture of experts (`dflash.models.moe`) in the layers `ModelConfig.sparse_layer` names."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from dflash.config import ModelConfig
from dflash.kv.cache import AttentionBackend, CacheWriter
from dflash.models.layers import Attention, AttentionMask, GatedMLP, RMSNorm
from dflash.models.model import CausalLM
from dflash.models.moe import SparseMoeBlock, grouped_experts
from dflash.models.moe_weights import join_gate_up, stack_expert_weights


class Qwen3MoeDecoderLayer(nn.Module):
    """Pre-norm block as in Qwen3; its MLP is a `SparseMoeBlock` or, in the dense layers, a `GatedMLP`."""

    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        dim, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Attention(config, layer_index)
        self.mlp: nn.Module = (
            SparseMoeBlock(config)
            if config.sparse_layer(layer_index)
            else GatedMLP(dim, config.intermediate_size, config.hidden_act)
        )
        self.input_layernorm = RMSNorm(dim, eps)
        self.post_attention_layernorm = RMSNorm(dim, eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: AttentionMask,
        cache: CacheWriter | AttentionBackend | None,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3MoeForCausalLM(CausalLM):
    """Captured in CUDA graphs where its experts run through the grouped product (a GPU in 16-bit floats: no host
    decision); elsewhere the per-expert products read their token counts on the host, which no graph can replay."""

    layer_class: ClassVar[type[nn.Module]] = Qwen3MoeDecoderLayer

    @property
    def capturable(self) -> bool:
        return grouped_experts(self.embed_tokens.weight)

    def load_weights(self, weights: dict[str, torch.Tensor], source: str = "checkpoint") -> None:
        """Experts in any checkpoint form (`dflash.models.moe_weights`); gate and up joined per expert."""
        super().load_weights(join_gate_up(self.config, stack_expert_weights(self.config, weights, source)), source)
