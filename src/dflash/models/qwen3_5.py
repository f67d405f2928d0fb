"""Qwen3.5 hybrid family: Gated DeltaNet linear-attention layers interleaved with gated full-attention layers.

Full-attention layers differ from Qwen3's by an output gate (the query projection yields, per head, the query
then a gate; the attention output is multiplied by sigmoid(gate)) and by partial RoPE (only the first
`config.rotary_dim` channels of a head rotate). Every RMSNorm scales by (1 + weight), except the gated norm inside
the linear layers. Linear layers keep their past in the cache's `RecurrentStates`, full layers in its K/V slots;
each kind is numbered by its own slot, so the K/V cache holds only the full-attention layers.

A tree verification (`tree_mask`) takes each row along its own path through the recurrent state; arbitrary
attention masks are not supported (a recurrent state cannot follow one). The batched engine core serves the
family with one recurrent state per request, trees included.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn

from dflash.config import LINEAR_ATTENTION, ModelConfig
from dflash.errors import GenerationError, ModelLoadError
from dflash.kv.cache import AttentionBackend, CacheWriter, KVCache
from dflash.models.gated_deltanet import GatedDeltaNet, new_recurrent_states
from dflash.models.layers import Attention, AttentionMask, GatedMLP, RMSNorm
from dflash.models.model import CausalLM, ForwardOutput, LogitsMode
from dflash.models.moe import SharedExpertMoeBlock
from dflash.models.rope import apply_rotary

if TYPE_CHECKING:
    from dflash.parallel.group import TensorParallel


def kind_slot(config: ModelConfig, layer_index: int) -> int:
    """The layer's index among the layers of its own kind (linear or attention)."""
    kind = config.layer_types[layer_index] == LINEAR_ATTENTION
    return sum((t == LINEAR_ATTENTION) == kind for t in config.layer_types[:layer_index])


class GatedAttention(Attention):
    """Attention with a sigmoid output gate from the query projection and RoPE on the first `rotary_dim` channels.
    The fused projection holds, per head, query then gate rows ([heads * 2 * head_dim] outputs), then K, then V."""

    def __init__(self, config: ModelConfig, slot: int) -> None:
        super().__init__(config, slot)  # `layer_index` is the K/V cache slot
        q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        self.split_sizes = (2 * q_size, kv_size, kv_size)
        self.qkv_proj = nn.Linear(config.hidden_size, 2 * q_size + 2 * kv_size, bias=config.attention_bias)
        self.rotary_dim = config.rotary_dim

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: AttentionMask,
        cache: CacheWriter | AttentionBackend | None,
    ) -> torch.Tensor:
        batch, seq, _ = x.shape
        query_gate, k, v = self.qkv_proj(x).split(self.split_sizes, dim=-1)
        q, gate = query_gate.view(batch, seq, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        k = k.view(batch, seq, self.num_kv_heads, self.head_dim)
        assert self.q_norm is not None and self.k_norm is not None  # the family always has q/k norms
        q = self._rotate(self.q_norm(q).transpose(1, 2), cos, sin)  # [batch, heads, seq, head_dim]
        k = self._rotate(self.k_norm(k).transpose(1, 2), cos, sin)  # [batch, kv_heads, seq, head_dim]
        v = v.view(batch, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        out = self.attend(q, k, v, mask, cache)  # [batch, seq, heads * head_dim]
        return self.o_proj(out * torch.sigmoid(gate.reshape(batch, seq, -1)))

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.rotary_dim == self.head_dim:
            return apply_rotary(x, cos, sin)
        rotated = apply_rotary(x[..., : self.rotary_dim], cos, sin)
        return torch.cat((rotated, x[..., self.rotary_dim :]), dim=-1)


class Qwen35DecoderLayer(nn.Module):
    """Pre-norm block whose token mixer is Gated DeltaNet (`linear_attn`) or gated attention (`self_attn`), and whose
    MLP is a mixture of experts in the layers the configuration lists (Qwen3.5-MoE, Qwen3-Next)."""

    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        dim, eps = config.hidden_size, config.rms_norm_eps
        self.linear_attn: GatedDeltaNet | None = None
        self.self_attn: GatedAttention | None = None
        if config.layer_types[layer_index] == LINEAR_ATTENTION:
            self.linear_attn = GatedDeltaNet(config, kind_slot(config, layer_index))
        else:
            self.self_attn = GatedAttention(config, kind_slot(config, layer_index))
        self.mlp: nn.Module = (
            SharedExpertMoeBlock(config) if config.sparse_layer(layer_index)
            else GatedMLP(dim, config.intermediate_size, config.hidden_act)
        )
        self.input_layernorm = RMSNorm(dim, eps, adds_one=True)
        self.post_attention_layernorm = RMSNorm(dim, eps, adds_one=True)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: AttentionMask,
        cache: CacheWriter | AttentionBackend | None,
    ) -> torch.Tensor:
        normed = self.input_layernorm(x)
        if self.linear_attn is not None:
            x = x + self.linear_attn(normed, cache)
        else:
            assert self.self_attn is not None
            x = x + self.self_attn(normed, cos, sin, mask, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen35ForCausalLM(CausalLM):
    layer_class: ClassVar[type[nn.Module]] = Qwen35DecoderLayer

    def __init__(self, config: ModelConfig, tensor_parallel: TensorParallel | None = None) -> None:
        if tensor_parallel is not None and tensor_parallel.world > 1:
            raise ModelLoadError("tensor parallelism does not split linear-attention layers yet")
        super().__init__(config)

    def new_cache(self, capacity: int, batch: int = 1) -> KVCache:
        """K/V slots for the full-attention layers only, plus the linear layers' recurrent states."""
        config = self.config
        like = self.embed_tokens.weight
        cache = KVCache(
            config.cache_layers, config.num_kv_heads, config.head_dim, capacity,
            batch=batch, dtype=like.dtype, device=like.device,
        )
        cache.recurrent = new_recurrent_states(config, like, batch)
        return cache

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        cache: KVCache | None = None,
        *,
        attn_mask: torch.Tensor | None = None,
        tree_mask: torch.Tensor | None = None,
        capture: Sequence[int] = (),
        logits: LogitsMode = "all",
    ) -> ForwardOutput:
        """As `CausalLM.forward`, for causal rows or a verification tree (`tree_mask`: the linear layers then take
        each row along its own path, `RecurrentStates.tree_ancestors`); no custom attention mask (a recurrent state
        cannot follow one)."""
        if attn_mask is not None:
            raise GenerationError("linear-attention layers take causal rows or a tree only (no attention mask)")
        if cache is not None and cache.recurrent is None:
            raise GenerationError("a hybrid model needs a cache from its own new_cache (with recurrent state)")
        if tree_mask is None:
            return super().forward(input_ids, positions, cache, capture=capture, logits=logits)
        if cache is None or cache.recurrent is None:
            raise GenerationError("a tree verification of a hybrid model needs its cache")
        cache.recurrent.tree_ancestors = tree_mask.to(self.embed_tokens.weight.device, torch.bool)
        try:
            return super().forward(input_ids, positions, cache, tree_mask=tree_mask, capture=capture, logits=logits)
        finally:
            cache.recurrent.tree_ancestors = None

