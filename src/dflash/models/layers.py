"""Building blocks shared by every family: RMSNorm, attention over the static cache, gated MLP."""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from dflash.config import ModelConfig
from dflash.kernels.fused_cpu import layer_ops
from dflash.kv.cache import AttentionBackend, CacheWriter
from dflash.models.rope import apply_rotary


def embedding(rows: int, dim: int) -> nn.Embedding:
    """nn.Embedding(rows, dim), its table drawn from N(0, 1) as nn.Embedding's own, except on the meta device
    (models built there before their weights are loaded): torch draws meta tensors through its reference ops,
    whose first use imports the compiler stack (torch._dynamo, about 140 MiB of resident memory)."""
    table = torch.empty(rows, dim)
    if not table.is_meta:
        nn.init.normal_(table)
    return nn.Embedding(rows, dim, _weight=table)


class RMSNorm(nn.Module):
    """RMSNorm computed in float32; Gemma scales by (1 + weight), the others by weight."""

    def __init__(self, dim: int, eps: float, adds_one: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if adds_one else torch.ones(dim))
        self.eps = eps
        self.adds_one = adds_one

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = layer_ops(x)
        if ops is not None:
            return ops.rms_norm(x, self.weight, self.eps, self.adds_one)
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.adds_one:
            return (normed * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * normed.to(x.dtype)


def activation(name: str) -> nn.Module:
    if name == "silu":
        return nn.SiLU()
    if name in ("gelu_pytorch_tanh", "gelu_tanh"):
        return nn.GELU(approximate="tanh")
    if name == "gelu":
        return nn.GELU()
    raise ValueError(f"unsupported activation {name!r}")


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with gate and up fused in one matrix."""

    def __init__(self, hidden: int, intermediate: int, act: str) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.act = activation(act)
        self.intermediate = intermediate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [..., 2 * intermediate]
        ops = layer_ops(gate_up) if isinstance(self.act, nn.SiLU) else None
        if ops is not None:
            return self.down_proj(ops.silu_mul(gate_up))
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return self.down_proj(self.act(gate) * up)


class CausalMask:
    """Marks plain causal attention among the new tokens alone (no cache, positions 0..seq-1): SDPA's causal
    kernels serve it without a materialised mask (the frozen target's forward over training batches)."""


CAUSAL = CausalMask()
AttentionMask = torch.Tensor | CausalMask | None


# Query rows up to which the fused CPU attention runs (decode steps, verifications, trees, the drafter's block);
# longer prefill chunks go to SDPA, whose blocked products win there.
FUSED_ATTENTION_MAX_ROWS = 64


def fits_attention_kernel(q: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Whether the fused CPU attention takes these queries [batch, heads, rows, head_dim] and this mask (none, or
    bool [batch or 1, 1, rows, keys])."""
    if q.shape[2] > FUSED_ATTENTION_MAX_ROWS:
        return False
    return mask is None or (mask.dtype == torch.bool and mask.dim() == 4 and mask.shape[1] == 1)


class Attention(nn.Module):
    """Grouped-query attention with fused QKV, optional per-head q/k norm, writing into a KVCache."""

    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.attention_scale
        q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        self.split_sizes = (q_size, kv_size, kv_size)
        self.qkv_proj = nn.Linear(config.hidden_size, q_size + 2 * kv_size, bias=config.attention_bias)
        # attention_bias (Llama, Qwen3, Gemma 3 in transformers): every attention projection has a bias, the output's too
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=config.attention_bias)
        self.q_norm: nn.Module | None = None
        self.k_norm: nn.Module | None = None
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, config.norm_adds_one)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, config.norm_adds_one)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: AttentionMask,
        cache: CacheWriter | AttentionBackend | None,
    ) -> torch.Tensor:
        """x: [batch, seq, hidden]; mask: [batch, 1, seq, keys] bool (True = visible), None (all visible) or
        CAUSAL; an `AttentionBackend` cache brings its own masks."""
        batch, seq, _ = x.shape
        q, k, v = self.qkv_proj(x).split(self.split_sizes, dim=-1)
        q = q.view(batch, seq, self.num_heads, self.head_dim)
        k = k.view(batch, seq, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rotary(q.transpose(1, 2), cos, sin)  # [batch, heads, seq, head_dim]
        k = apply_rotary(k.transpose(1, 2), cos, sin)  # [batch, kv_heads, seq, head_dim]
        v = v.view(batch, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return self.o_proj(self.attend(q, k, v, mask, cache))

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: AttentionMask,
        cache: CacheWriter | AttentionBackend | None,
    ) -> torch.Tensor:
        """Store the new K/V and attend. q: [batch, heads, seq, head_dim]; k, v: [batch, kv_heads, seq, head_dim]
        (rotated) -> [batch, seq, heads * head_dim], before the output projection."""
        batch, _, seq, _ = q.shape
        attend = getattr(cache, "attend", None)  # an AttentionBackend (a runtime protocol check costs ~10 us)
        if attend is not None:
            return cast(torch.Tensor, attend(self.layer_index, q, k, v, self.scale))
        if cache is not None:
            k, v = cast(CacheWriter, cache).write(self.layer_index, k, v)
        gqa = self.num_heads != self.num_kv_heads
        if isinstance(mask, CausalMask):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, enable_gqa=gqa)
            return out.transpose(1, 2).reshape(batch, seq, -1)
        ops = layer_ops(q)
        if ops is not None and fits_attention_kernel(q, mask):
            return cast(torch.Tensor, ops.attention(q, k, v, mask, self.scale))  # [batch, seq, heads * head_dim]
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=self.scale, enable_gqa=gqa
        )
        return out.transpose(1, 2).reshape(batch, seq, -1)


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x)) (Llama, Qwen3)."""

    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer_index)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_adds_one)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_adds_one)

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
