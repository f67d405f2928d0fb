"""Gemma 4 text family: Gemma 3's sandwich-normed layers, plus what Gemma 4 adds.

* Plain RMSNorm weights (no 1 + w), q/k norms, an unscaled value norm, and attention logits scaled by 1 (the norms
  set their size); a learned scalar multiplies each layer's output.
* Full-attention layers may have wider heads and fewer K/V heads than the sliding ones, RoPE on only part of each
  head ("proportional" RoPE, `dflash.models.rope`), and values taken from the key projection (`attention_k_eq_v`).
* Per-layer inputs: a second embedding table gives every token a small vector per layer, mixed with a projection of
  the main embedding; each layer gates it into its residual stream after the MLP.
* K/V sharing: the last `num_kv_shared_layers` layers compute no keys or values; they attend to those of the last
  earlier layer of their type (`ModelConfig.kv_source`). A sharing layer re-stores its source's new rows in the
  source's cache slots (the same values again), so every cache and attention backend serves it unchanged.

Every layer but the sharing ones keeps a cache row of the widest head size (`ModelConfig.cache_head_dim`); narrower
layers use the first part of it. The mixture-of-experts variant is declined when the config is read.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, cast

import torch
import torch.nn.functional as F
from torch import nn

from dflash.config import FULL_ATTENTION, ModelConfig
from dflash.errors import ModelLoadError
from dflash.kernels.fused_cpu import layer_ops
from dflash.kv.cache import AttentionBackend, CacheWriter, KVCache
from dflash.models.layers import (
    AttentionMask,
    CausalMask,
    GatedMLP,
    RMSNorm,
    activation,
    embedding,
    fits_attention_kernel,
)
from dflash.models.model import CausalLM
from dflash.models.rope import Rotary, apply_rotary

if TYPE_CHECKING:
    from collections.abc import Sequence

    from dflash.parallel.group import TensorParallel

# The new rows' keys and values of each layer that later layers read, within one forward:
# layer -> (rotated keys, normed values), each [batch, kv_heads, seq, head_dim].
SharedKV = dict[int, tuple[torch.Tensor, torch.Tensor]]


class Gemma4RMSNorm(RMSNorm):
    """RMSNorm whose weight multiplies the float32 normed values before the cast back, in transformers' Gemma 4
    order (the same as `RMSNorm` in float32, a rounding apart in bfloat16)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return super().forward(x)
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * self.weight.float()).to(x.dtype)


def unit_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without a weight over the last dimension, in float32 (Gemma 4's value norm)."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class Gemma4Attention(nn.Module):
    """Attention of one Gemma 4 layer, with its own head size; q, k (and v) fused in `qkv_proj` as far as the layer
    has them (a K/V-sharing layer has only q)."""

    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.source = config.kv_source(layer_index)  # the layer whose K/V this one reads (itself unless shared)
        # whether later layers read this one's K/V (only those rows are kept through the forward)
        self.feeds_later = any(config.kv_source(j) == layer_index for j in range(layer_index + 1, config.num_layers))
        self.num_heads = config.num_heads
        self.num_kv_heads = config.layer_kv_heads(layer_index)
        self.head_dim = config.layer_head_dim(layer_index)
        self.scale = config.attention_scale
        self.eps = config.rms_norm_eps
        full = config.layer_types[layer_index] == FULL_ATTENTION
        self.values_from_keys = config.attention_k_eq_v and full
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if self.source != layer_index:
            self.split_sizes: tuple[int, ...] = (q_size,)
        elif self.values_from_keys:
            self.split_sizes = (q_size, kv_size)
        else:
            self.split_sizes = (q_size, kv_size, kv_size)
        self.qkv_proj = nn.Linear(config.hidden_size, sum(self.split_sizes), bias=config.attention_bias)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=config.attention_bias)
        self.q_norm = Gemma4RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = Gemma4RMSNorm(self.head_dim, config.rms_norm_eps) if self.source == layer_index else None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: AttentionMask,
        cache: CacheWriter | AttentionBackend | None,
        shared: SharedKV,
    ) -> torch.Tensor:
        """x: [batch, seq, hidden] -> [batch, seq, hidden]; `shared` receives this layer's new K/V when later
        layers read them, and gives a sharing layer its source's."""
        batch, seq, _ = x.shape
        parts = self.qkv_proj(x).split(self.split_sizes, dim=-1)
        q = self.q_norm(parts[0].view(batch, seq, self.num_heads, self.head_dim))
        q = apply_rotary(q.transpose(1, 2), cos, sin)  # [batch, heads, seq, head_dim]
        if self.k_norm is None:
            k, v = shared[self.source]
        else:
            raw_k = parts[1].view(batch, seq, self.num_kv_heads, self.head_dim)
            raw_v = raw_k if self.values_from_keys else parts[2].view(batch, seq, self.num_kv_heads, self.head_dim)
            k = apply_rotary(self.k_norm(raw_k).transpose(1, 2), cos, sin)  # [batch, kv_heads, seq, head_dim]
            v = unit_rms_norm(raw_v, self.eps).transpose(1, 2)  # [batch, kv_heads, seq, head_dim]
            if self.feeds_later:
                shared[self.layer_index] = (k, v)
        attend = getattr(cache, "attend", None)  # an AttentionBackend
        if attend is not None:
            return self.o_proj(attend(self.source, q, k, v, self.scale))
        if cache is not None:  # a sharing layer writes its source's rows again: the same values in the same slots
            k, v = cast(CacheWriter, cache).write(self.source, k, v)
        gqa = self.num_heads != self.num_kv_heads
        if isinstance(mask, CausalMask):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, enable_gqa=gqa)
            return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))
        ops = layer_ops(q)
        if ops is not None and fits_attention_kernel(q, mask):
            return self.o_proj(ops.attention(q, k, v, mask, self.scale))  # [batch, seq, heads * head_dim]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale, enable_gqa=gqa)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))


class Gemma4DecoderLayer(nn.Module):
    """Gemma 3's block (norms before and after attention and MLP), then the gated per-layer input, then the
    layer's scalar."""

    layer_scalar: torch.Tensor

    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        dim, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Gemma4Attention(config, layer_index)
        self.mlp = GatedMLP(dim, config.layer_intermediate_size(layer_index), config.hidden_act)
        self.input_layernorm = Gemma4RMSNorm(dim, eps)
        self.post_attention_layernorm = Gemma4RMSNorm(dim, eps)
        self.pre_feedforward_layernorm = Gemma4RMSNorm(dim, eps)
        self.post_feedforward_layernorm = Gemma4RMSNorm(dim, eps)
        self.register_buffer("layer_scalar", torch.ones(1))  # in checkpoints, as transformers saves it
        per_layer = config.hidden_size_per_layer_input
        self.per_layer_input_gate: nn.Linear | None = None
        if per_layer:
            self.per_layer_input_gate = nn.Linear(dim, per_layer, bias=False)
            self.per_layer_projection = nn.Linear(per_layer, dim, bias=False)
            self.post_per_layer_input_norm = Gemma4RMSNorm(dim, eps)
            self.act = activation(config.hidden_act)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: AttentionMask,
        cache: CacheWriter | AttentionBackend | None,
        shared: SharedKV,
        per_layer_input: torch.Tensor | None,
    ) -> torch.Tensor:
        """x: [batch, seq, hidden]; per_layer_input: [batch, seq, hidden_size_per_layer_input] or None."""
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, mask, cache, shared))
        x = x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        if self.per_layer_input_gate is not None and per_layer_input is not None:
            gated = self.act(self.per_layer_input_gate(x)) * per_layer_input
            x = x + self.post_per_layer_input_norm(self.per_layer_projection(gated))
        return x * self.layer_scalar


class Gemma4ForCausalLM(CausalLM):
    """The Gemma 4 text model. Its cache rows have the widest head size, and the K/V-sharing layers have none; CUDA
    graphs are not used for it (its
    mixed head sizes and shared K/V were never checked under capture)."""

    layer_class: ClassVar[type[nn.Module]] = Gemma4DecoderLayer

    @property
    def capturable(self) -> bool:
        return False

    def __init__(self, config: ModelConfig, tensor_parallel: TensorParallel | None = None) -> None:
        if tensor_parallel is not None and tensor_parallel.world > 1:
            raise ModelLoadError("Gemma 4 models are not split across devices yet; run them on one device")
        super().__init__(config, tensor_parallel)
        self.norm = Gemma4RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = Rotary(config.global_head_dim or config.head_dim, config.rope_theta, config.rope_scaling)
        self.rotary_local = Rotary(config.head_dim, config.rope_local_theta or 10000.0)
        per_layer = config.hidden_size_per_layer_input
        if per_layer:
            packed = config.num_layers * per_layer  # every layer's vector, side by side
            self.embed_tokens_per_layer = embedding(config.vocab_size_per_layer_input, packed)
            self.per_layer_model_projection = nn.Linear(config.hidden_size, packed, bias=False)
            self.per_layer_projection_norm = Gemma4RMSNorm(per_layer, config.rms_norm_eps)

    def new_cache(self, capacity: int, batch: int = 1) -> KVCache:
        config, like = self.config, self.embed_tokens.weight
        return KVCache(  # no rows for the K/V-sharing layers: they attend in their sources' rows
            config.cache_layers, config.cache_kv_heads, config.cache_head_dim, capacity,
            batch=batch, dtype=like.dtype, device=like.device,
        )

    def per_layer_inputs(self, input_ids: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor | None:
        """input_ids: [batch, seq], embedded: their scaled embeddings [batch, seq, hidden] -> [batch, seq, layers,
        per_layer]: (norm(projection of the embedding) + the token's own per-layer embedding) / sqrt(2)."""
        per_layer = self.config.hidden_size_per_layer_input
        if not per_layer:
            return None
        shape = (*input_ids.shape, self.config.num_layers, per_layer)
        # the scales are rounded to the weights' dtype, or not, where transformers does so (bf16 agrees too)
        own = self.embed_tokens_per_layer(input_ids) * torch.tensor(per_layer**0.5, dtype=embedded.dtype)
        projected = self.per_layer_model_projection(embedded) * self.config.hidden_size**-0.5
        mixed = self.per_layer_projection_norm(projected.view(shape)) + own.view(shape)
        return mixed * 2.0**-0.5

    def run_layers(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        full_mask: AttentionMask,
        sliding_mask: torch.Tensor | None,
        cache: CacheWriter | AttentionBackend | None,
        capture: Sequence[int],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        dtype = self.embed_tokens.weight.dtype
        cos, sin = self.rotary.cos_sin(positions, dtype)  # full-attention layers' widths and bases
        local_cos, local_sin = self.rotary_local.cos_sin(positions, dtype)
        wanted = set(capture)
        captured: dict[int, torch.Tensor] = {}
        x = self.embed(input_ids)
        per_layer = self.per_layer_inputs(input_ids, x)  # [batch, seq, layers, per_layer] or None
        shared: SharedKV = {}
        for index, layer in enumerate(self.layers):
            extra = per_layer[:, :, index] if per_layer is not None else None
            if self.sliding[index]:
                x = layer(x, local_cos, local_sin, sliding_mask, cache, shared, extra)
            else:
                x = layer(x, cos, sin, full_mask, cache, shared, extra)
            if index in wanted:
                captured[index] = x
        features = torch.cat([captured[layer] for layer in capture], dim=-1) if capture else None
        return x, features

    def load_weights(self, weights: dict[str, torch.Tensor], source: str = "checkpoint") -> None:
        """Join each layer's q, k (and v) into `qkv_proj` as far as it has them; checkpoints that still carry K/V
        projections or norms of the sharing layers (transformers ignores them) have them dropped."""
        weights = dict(weights)
        for index, layer in enumerate(self.layers):
            attention = cast(Gemma4Attention, cast(Gemma4DecoderLayer, layer).self_attn)
            prefix = f"model.layers.{index}.self_attn."
            names = "q" if attention.k_norm is None else ("qk" if attention.values_from_keys else "qkv")
            for kind in ("weight", "bias"):
                parts = [weights.pop(f"{prefix}{n}_proj.{kind}", None) for n in "qkv"]
                wanted = [parts["qkv".index(n)] for n in names]
                if all(t is not None for t in wanted):
                    weights[f"{prefix}qkv_proj.{kind}"] = torch.cat(wanted, dim=0)  # type: ignore[arg-type]
            if attention.k_norm is None:
                for name in ("k_norm", "v_norm"):
                    weights.pop(f"{prefix}{name}.weight", None)
        super().load_weights(weights, source)
