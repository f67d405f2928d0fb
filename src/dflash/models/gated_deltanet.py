"""Gated DeltaNet: the linear-attention token mixer of Qwen3.5's hybrid layers.

Per token: project to q, k, v (one matrix), run them through a causal depthwise convolution of width `kernel`
(SiLU after it), L2-normalise q and k, and feed the gated delta rule (`dflash.models.delta_rule`) with a decay
g = -exp(A_log) * softplus(a + dt_bias) and a write strength beta = sigmoid(b). The read-out of each value head is
RMS-normalised, gated by SiLU(z) and projected back to the hidden size.

The past lives in the cache's `RecurrentStates` (convolution window plus state matrix per head), indexed by this
layer's position among the linear layers (`slot`). Parameter names follow transformers' checkpoints.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dflash.config import ModelConfig
from dflash.errors import GenerationError
from dflash.kv.cache import AttentionBackend, CacheWriter, KVCache
from dflash.kv.recurrent import DeltaRows, RecurrentShape
from dflash.models.delta_rule import RECURRENT_MAX_ROWS, chunked_delta_rule, recurrent_delta_rule


def recurrent_shape(config: ModelConfig) -> RecurrentShape:
    """Sizes of a linear layer's window and state for `config`."""
    key_size = config.linear_num_key_heads * config.linear_key_head_dim
    value_size = config.linear_num_value_heads * config.linear_value_head_dim
    return RecurrentShape(
        conv_channels=2 * key_size + value_size,
        conv_kernel=config.linear_conv_kernel,
        value_heads=config.linear_num_value_heads,
        key_dim=config.linear_key_head_dim,
        value_dim=config.linear_value_head_dim,
    )


class GatedRMSNorm(nn.Module):
    """weight * rmsnorm(x) * silu(gate) over the last dimension (one value head), normalised in float32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (self.weight * normed * F.silu(gate.float())).to(x.dtype)


def l2_normalise(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dimension (eps inside the root, as the reference kernels do)."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


class GatedDeltaNet(nn.Module):
    def __init__(self, config: ModelConfig, slot: int) -> None:
        super().__init__()
        self.slot = slot
        self.shape = recurrent_shape(config)
        self.key_heads, self.value_heads = config.linear_num_key_heads, config.linear_num_value_heads
        self.key_dim, self.value_dim = config.linear_key_head_dim, config.linear_value_head_dim
        key_size, value_size = self.key_heads * self.key_dim, self.value_heads * self.value_dim
        self.split_sizes = (key_size, key_size, value_size)
        channels, hidden = self.shape.conv_channels, config.hidden_size
        self.in_proj_qkv = nn.Linear(hidden, channels, bias=False)
        self.in_proj_z = nn.Linear(hidden, value_size, bias=False)
        self.in_proj_b = nn.Linear(hidden, self.value_heads, bias=False)
        self.in_proj_a = nn.Linear(hidden, self.value_heads, bias=False)
        self.conv1d = nn.Conv1d(channels, channels, config.linear_conv_kernel, groups=channels, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.value_heads))
        self.A_log = nn.Parameter(torch.zeros(self.value_heads))
        self.norm = GatedRMSNorm(self.value_dim, config.rms_norm_eps)
        self.out_proj = nn.Linear(value_size, hidden, bias=False)

    def forward(self, x: torch.Tensor, cache: CacheWriter | AttentionBackend | None) -> torch.Tensor:
        """x: [batch, seq, hidden] -> [batch, seq, hidden]; reads and updates the cache's recurrent state."""
        batch, seq, _ = x.shape
        states = None
        if cache is not None:
            states = cache.recurrent if isinstance(cache, KVCache) else None
            if states is None:
                raise GenerationError("this cache keeps no linear-attention state (hybrid models run one sequence)")
        conv_inputs = self.in_proj_qkv(x)  # [batch, seq, channels]
        if states is not None:
            window, state = states.read(self.slot)
        else:
            window = conv_inputs.new_zeros(batch, self.shape.conv_kernel - 1, self.shape.conv_channels)
            state = x.new_zeros(batch, self.value_heads, self.key_dim, self.value_dim, dtype=torch.float32)
        extended = torch.cat((window, conv_inputs), dim=1)  # [batch, kernel - 1 + seq, channels]
        mixed = F.silu(F.conv1d(extended.transpose(1, 2), self.conv1d.weight, groups=self.shape.conv_channels))
        q, k, v = mixed.transpose(1, 2).split(self.split_sizes, dim=-1)  # each [batch, seq, heads * dim]
        group = self.value_heads // self.key_heads  # each q/k head serves `group` consecutive value heads
        q = self._heads(q, self.key_heads, self.key_dim).repeat_interleave(group, dim=1)
        k = self._heads(k, self.key_heads, self.key_dim).repeat_interleave(group, dim=1)
        v = self._heads(v, self.value_heads, self.value_dim)  # [batch, value_heads, seq, value_dim]
        q = l2_normalise(q) * self.key_dim**-0.5
        k = l2_normalise(k)
        beta = self.in_proj_b(x).float().sigmoid().transpose(1, 2)  # [batch, value_heads, seq]
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias.float())
        g = g.transpose(1, 2)  # [batch, value_heads, seq], log decay <= 0
        rule = recurrent_delta_rule if seq <= RECURRENT_MAX_ROWS else chunked_delta_rule
        out, state = rule(q, k, v, g, beta, state)  # [batch, value_heads, seq, value_dim]
        if states is not None:
            new_window = extended[:, extended.shape[1] - (self.shape.conv_kernel - 1) :]
            states.write(self.slot, new_window, state, DeltaRows(conv_inputs, k, v, g, beta))
        z = self.in_proj_z(x).view(batch, seq, self.value_heads, self.value_dim)
        out = self.norm(out.transpose(1, 2).to(x.dtype), z)  # [batch, seq, value_heads, value_dim]
        return self.out_proj(out.reshape(batch, seq, -1))

    @staticmethod
    def _heads(x: torch.Tensor, heads: int, dim: int) -> torch.Tensor:
        """[batch, seq, heads * dim] -> float32 [batch, heads, seq, dim]."""
        batch, seq, _ = x.shape
        return x.view(batch, seq, heads, dim).transpose(1, 2).float()
