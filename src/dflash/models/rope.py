"""Rotary position embeddings (rotate-half layout) with the RoPE scaling types real checkpoints use."""

from __future__ import annotations

import math
from typing import Any

import torch

from dflash.errors import ModelLoadError
from dflash.kernels.fused_cpu import layer_ops


def rope_inverse_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] in float32 on the CPU, adjusted for `scaling` (linear, llama3,
    proportional). Always computed on the CPU: on the meta device (a model built before its weights are loaded)
    torch would evaluate them through its reference ops, whose first use imports its compiler stack (about 140 MiB)."""
    steps = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float()
    inv_freq = 1.0 / (theta ** (steps / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind in (None, "default"):
        return inv_freq
    assert scaling is not None
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        original = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
        smooth = (original / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= original / high) & (wavelen <= original / low)
        return torch.where(medium, smoothed, scaled)
    if kind == "proportional":
        # Gemma 4's full-attention layers rotate only the first `partial_rotary_factor` of each half-pair set, at
        # the frequencies a full rotation of head_dim would give them; the rest get frequency 0 (left as they are).
        rotated = int(float(scaling.get("partial_rotary_factor", 1.0)) * head_dim // 2)
        kept = inv_freq.clone()
        kept[rotated:] = 0.0
        return kept / float(scaling.get("factor", 1.0))
    raise ModelLoadError(f"unsupported rope_scaling type {kind!r} (supported: default, linear, llama3, proportional)")


class Rotary(torch.nn.Module):
    """Computes cos/sin for given positions and rotates query/key heads."""

    inv_freq: torch.Tensor

    def __init__(self, head_dim: int, theta: float, scaling: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.head_dim, self.theta, self.scaling = head_dim, theta, scaling
        inv_freq = rope_inverse_frequencies(head_dim, theta, scaling).to(torch.get_default_device())
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        # (dtype, device) -> cos, sin [positions, head_dim] precomputed for the graphed forwards (`prepare_table`)
        self._tables: dict[tuple[torch.dtype, str], tuple[torch.Tensor, torch.Tensor]] = {}

    def recompute(self) -> None:
        """Refill the frequency buffer in place (after a model was materialised from the meta device)."""
        fresh = rope_inverse_frequencies(self.head_dim, self.theta, self.scaling)
        self.inv_freq = fresh.to(self.inv_freq.device)
        self._tables.clear()

    def prepare_table(self, length: int, dtype: torch.dtype, device: torch.device) -> None:
        """Precompute cos/sin for positions 0 .. length-1, so that `rows_cos_sin` gathers rows instead of computing
        them (one kernel per table instead of several). Call it outside CUDA graph capture; positions passed to
        `rows_cos_sin` must then stay below `length`."""
        cos, sin = self.cos_sin(torch.arange(length, device=device)[None], dtype)  # [1, 1, length, head_dim]
        self._tables[(dtype, str(device))] = (cos[0, 0].contiguous(), sin[0, 0].contiguous())

    def table(self, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The prepared cos, sin table [positions, head_dim] for `dtype` on `device`, if `prepare_table` made one."""
        return self._tables.get((dtype, str(device)))

    def rows_cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [rows] -> cos, sin: [rows, head_dim] contiguous, equal to `cos_sin`'s (the same float32
        angles), from the prepared table when there is one."""
        table = self._tables.get((dtype, str(positions.device)))
        if table is not None:
            return table[0].index_select(0, positions), table[1].index_select(0, positions)
        cos, sin = self.cos_sin(positions[None], dtype)  # [1, 1, rows, head_dim]
        return cos[0, 0].contiguous(), sin[0, 0].contiguous()

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [batch, seq] -> cos, sin: [batch, 1, seq, head_dim]"""
        freqs = positions[..., None].float() * self.inv_freq  # [batch, seq, head_dim/2]
        angles = torch.cat((freqs, freqs), dim=-1)[:, None]
        return angles.cos().to(dtype), angles.sin().to(dtype)


def fits_rotary_kernel(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether cos/sin have the [batch or 1, 1, seq, head_dim] layout the fused CPU rotation takes."""
    return (
        x.dim() == 4
        and x.stride(-1) == 1
        and cos.shape == sin.shape
        and cos.dim() == 4
        and cos.shape[0] in (1, x.shape[0])
        and cos.shape[1:] == (1, x.shape[2], x.shape[3])
        and cos.dtype == sin.dtype == torch.float32
    )


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [batch, heads, seq, head_dim] rotated by position (rotate-half pairing j with j + head_dim/2)."""
    ops = layer_ops(x)
    if ops is not None and fits_rotary_kernel(x, cos, sin):
        return ops.rotary(x, cos, sin)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
