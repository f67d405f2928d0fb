"""Gated DeltaNet: the linear-attention token mixer of Qwen3.5's hybrid layers.

Per token: project to q, k, v (one matrix), run them through a causal depthwise convolution of width `kernel`
(SiLU after it), L2-normalise q and k, and feed the gated delta rule (`dflash.models.delta_rule`) with a decay
g = -exp(A_log) * softplus(a + dt_bias) and a write strength beta = sigmoid(b). The read-out of each value head is
RMS-normalised, gated by SiLU(z) and projected back to the hidden size.

A tree verification (the state's `tree_ancestors` set) convolves and updates each row along its own path instead
of after the row before it. Forwards of at most `ROLLBACK_MAX_ROWS` rows take one Triton program per layer for the
rule where it serves (`dflash.kernels.triton_delta_rule`: CUDA), the torch forms elsewhere. The past lives in a
`RecurrentStates` (convolution window plus state matrix per head), indexed by this layer's position among the
linear layers (`slot`): the `KVCache`'s of a single sequence, or one per request of a packed
batch (the batched core's attention backend lists them with their rows). Parameter names follow transformers'
checkpoints.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from dflash.config import LINEAR_ATTENTION, ModelConfig
from dflash.errors import GenerationError
from dflash.kernels.fla_delta_rule import fla_chunked_delta_rule, fla_usable
from dflash.kernels.triton_delta_rule import delta_rule_program_serves, delta_rule_rows
from dflash.kernels.triton_gated_deltanet import conv_taps
from dflash.kv.cache import AttentionBackend, CacheWriter, KVCache
from dflash.kv.recurrent import ROLLBACK_MAX_ROWS, DeltaRows, RecurrentShape, RecurrentStates, tree_parents
from dflash.kv.static_recurrent import StaticRecurrentStates
from dflash.models.delta_rule import (
    RECURRENT_MAX_ROWS,
    chunked_delta_rule,
    recurrent_delta_rule,
    tree_delta_rule,
)

# (q, k, v, g, beta, state) -> (outputs, final state), heads before time (`dflash.models.delta_rule`)
DeltaRule = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    tuple[torch.Tensor, torch.Tensor],
]


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


def new_recurrent_states(
    config: ModelConfig, like: torch.Tensor, batch: int = 1, *, static: bool = False
) -> RecurrentStates:
    """Empty states for every linear layer of `config`, windows in the dtype and on the device of `like`; `static`:
    in fixed buffers, for forwards replayed from CUDA graphs (`dflash.kv.static_recurrent`)."""
    layers = config.layer_types.count(LINEAR_ATTENTION)
    kind = StaticRecurrentStates if static else RecurrentStates
    return kind(layers, recurrent_shape(config), batch=batch, dtype=like.dtype, device=like.device)


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
        # Set by a builder that joins the first `joined_projections` of PROJECTIONS into one module (a quantized
        # model: one product and one input rounding instead of several); the joined modules are then removed.
        self.in_proj_joint: nn.Module | None = None
        self.joined_projections = 0

    # the input projections in the order of their outputs in a joint product
    PROJECTIONS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")

    def projection_sizes(self) -> tuple[int, int, int, int]:
        """Output sizes of PROJECTIONS."""
        return self.shape.conv_channels, self.value_heads * self.value_dim, self.value_heads, self.value_heads

    def join_input_projections(self, joint: nn.Module, count: int) -> None:
        """Use `joint` (outputs: the first `count` PROJECTIONS' rows, in order) instead of those modules."""
        self.in_proj_joint, self.joined_projections = joint, count
        for name in self.PROJECTIONS[:count]:
            delattr(self, name)

    def _projections(self, x: torch.Tensor) -> list[torch.Tensor]:
        """x [batch, seq, hidden] -> conv inputs [.., channels], z [.., value_heads * value_dim], b and a [..,
        value_heads]."""
        joined = self.joined_projections
        out = [] if self.in_proj_joint is None else list(
            self.in_proj_joint(x).split(self.projection_sizes()[:joined], dim=-1)
        )
        return out + [getattr(self, name)(x) for name in self.PROJECTIONS[joined:]]

    def forward(self, x: torch.Tensor, cache: CacheWriter | AttentionBackend | None) -> torch.Tensor:
        """x: [batch, seq, hidden] -> [batch, seq, hidden]; reads and updates the recurrent state of each sequence
        (one per `KVCache`, or one per request of a packed batch: the backend's `recurrent_segments`)"""
        batch, seq, _ = x.shape
        conv_inputs, z, write_strength, decay_input = self._projections(x)  # channels, value size, 2x value heads
        parts = [
            self._mix(conv_inputs[:, rows], write_strength[:, rows], decay_input[:, rows], states)
            for rows, states in self._sequences(seq, cache)
        ]
        out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)  # [batch, value_heads, seq, value_dim]
        z = z.reshape(batch, seq, self.value_heads, self.value_dim)
        out = self.norm(out.transpose(1, 2).to(x.dtype), z)  # [batch, seq, value_heads, value_dim]
        return self.out_proj(out.reshape(batch, seq, -1))

    @staticmethod
    def _sequences(
        seq: int, cache: CacheWriter | AttentionBackend | None
    ) -> list[tuple[slice, RecurrentStates | None]]:
        """Which rows belong to which sequence's state (None: no cache, start from zero and keep nothing)."""
        if cache is None:
            return [(slice(0, seq), None)]
        if isinstance(cache, KVCache):
            if cache.recurrent is None:
                raise GenerationError("this cache keeps no linear-attention state (make it with the model's new_cache)")
            return [(slice(0, seq), cache.recurrent)]
        packed = getattr(cache, "recurrent_segments", None)
        if packed is None:
            raise GenerationError("this attention backend keeps no linear-attention state")
        return cast(list[tuple[slice, RecurrentStates | None]], packed)

    def _mix(
        self, conv_inputs: torch.Tensor, write_strength: torch.Tensor, decay_input: torch.Tensor,
        states: RecurrentStates | None,
    ) -> torch.Tensor:
        """One sequence's rows: convolution and delta rule from its state -> [batch, value_heads, rows, value_dim]."""
        batch, seq, _ = conv_inputs.shape
        if states is not None:
            window, state = states.read(self.slot)
        else:
            window = conv_inputs.new_zeros(batch, self.shape.conv_kernel - 1, self.shape.conv_channels)
            size = (batch, self.value_heads, self.key_dim, self.value_dim)
            state = torch.zeros(size, dtype=torch.float32, device=conv_inputs.device)
        extended = torch.cat((window, conv_inputs), dim=1)  # [batch, kernel - 1 + seq, channels]
        ancestors = states.tree_ancestors if states is not None else None
        if ancestors is None:
            mixed = F.silu(F.conv1d(extended.transpose(1, 2), self.conv1d.weight, groups=self.shape.conv_channels))
        else:
            mixed = self._tree_convolution(extended, ancestors)
        q, k, v = mixed.transpose(1, 2).split(self.split_sizes, dim=-1)  # each [batch, seq, heads * dim]
        group = self.value_heads // self.key_heads  # each q/k head serves `group` consecutive value heads
        q = self._heads(q, self.key_heads, self.key_dim).repeat_interleave(group, dim=1)
        k = self._heads(k, self.key_heads, self.key_dim).repeat_interleave(group, dim=1)
        v = self._heads(v, self.value_heads, self.value_dim)  # [batch, value_heads, seq, value_dim]
        q = l2_normalise(q) * self.key_dim**-0.5
        k = l2_normalise(k)
        beta = write_strength.float().sigmoid().transpose(1, 2)  # [batch, value_heads, seq]
        g = -self.A_log.float().exp() * F.softplus(decay_input.float() + self.dt_bias.float())
        g = g.transpose(1, 2)  # [batch, value_heads, seq], log decay <= 0
        count = states.count_rows if states is not None else None  # a padded graph's live rows (device)
        new_state: torch.Tensor | None
        if seq <= ROLLBACK_MAX_ROWS and delta_rule_program_serves(q):
            final = states.final_buffer(self.slot) if states is not None else None
            read, new_state = delta_rule_rows(q, k, v, g, beta, state, ancestors=ancestors, final=final, count=count)
            assert read is not None
            out = read
        elif ancestors is not None:  # each row from its parent's state; the state keeps the accepted path later
            out, new_state = tree_delta_rule(q, k, v, g, beta, state, tree_parents(ancestors)), None
        elif count is not None:  # padded rows (the runner's eager path): the state after the live rows only
            live = int(count)
            out, new_state = recurrent_delta_rule(q[:, :, :live], k[:, :, :live], v[:, :, :live],
                                                  g[:, :, :live], beta[:, :, :live], state)
            out = F.pad(out, (0, 0, 0, seq - live))
        else:
            rule = recurrent_delta_rule if seq <= RECURRENT_MAX_ROWS else _chunked_rule(q)
            out, new_state = rule(q, k, v, g, beta, state)
        if states is not None:
            if ancestors is not None:
                new_window = window
            else:  # the last kernel - 1 inputs before the live rows' end
                index = torch.arange(self.shape.conv_kernel - 1, device=extended.device)
                new_window = extended.index_select(1, index + (seq if count is None else count))
            states.write(self.slot, new_window, new_state, DeltaRows(conv_inputs, k, v, g, beta))
        return out

    def _tree_convolution(self, extended: torch.Tensor, ancestors: torch.Tensor) -> torch.Tensor:
        """The causal convolution of tree rows, each over its own path: the newest `kernel` of the window's rows
        and its path's rows (ancestors and itself, in order). extended: [batch, kernel - 1 + rows, channels] (window
        then rows); ancestors [rows, rows] bool -> SiLU'd [batch, channels, rows], as the linear convolution gives
        for a chain. Found on the device (no host read: a CUDA graph can take it)."""
        kernel = self.shape.conv_kernel
        rows = ancestors.shape[0]
        taps = conv_taps(rows, kernel, ancestors, extended.device).long()  # [rows, kernel], oldest first
        batch, _, channels = extended.shape
        gathered = extended[:, taps]  # [batch, rows, kernel, channels]
        per_row = gathered.reshape(-1, kernel, channels).transpose(1, 2)  # [batch * rows, channels, kernel]
        mixed = F.silu(F.conv1d(per_row, self.conv1d.weight, groups=channels))  # [batch * rows, channels, 1]
        return mixed.view(batch, rows, channels).transpose(1, 2)

    @staticmethod
    def _heads(x: torch.Tensor, heads: int, dim: int) -> torch.Tensor:
        """[batch, seq, heads * dim] -> float32 [batch, heads, seq, dim]."""
        batch, seq, _ = x.shape
        return x.view(batch, seq, heads, dim).transpose(1, 2).float()


def _chunked_rule(rows: torch.Tensor) -> DeltaRule:
    """The chunked form for a prompt chunk: flash-linear-attention's kernels on CUDA where installed, torch else."""
    return fla_chunked_delta_rule if fla_usable(rows) else chunked_delta_rule
