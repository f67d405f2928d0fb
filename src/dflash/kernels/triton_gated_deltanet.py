"""A Gated DeltaNet layer's work around the delta rule in two Triton programs, for the graph runner's fused hybrid
forward (`dflash.fastpath.fused_hybrid`).

In torch a linear layer of a few rows is some sixty kernels: the causal convolution and its SiLU, the q/k/v split,
float copies, repeated key heads, two L2 norms, the decay's and write strength's element-wise chain, the gated
RMSNorm. Each costs a few microseconds on a GPU whatever its size, which at 48 such layers is more time than a
27B model's weights take to stream. Here:

* `gdn_inputs`: from the row's joined projection (q, k, v channels, then z, b, a) and the convolution window, per
  row and head: the convolution over the row's taps (a chain's last `kernel` positions, or a tree row's own path:
  `conv_taps`), SiLU, L2-normalised q (scaled) and k, v, and the decay and write strength; heads first, float32,
  key heads not repeated (the delta rule's program maps each value head to its key head);
* `gated_norm`: the read-out's RMSNorm times the norm weight and SiLU(z), in the output dtype.

They run on CUDA and, for the tests, on the CPU under TRITON_INTERPRET=1.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import torch

from dflash.kernels.triton_decode import next_power_of_two
from dflash.kv.recurrent import DeltaRows


@cache
def _programs() -> tuple[Any, Any]:
    from dflash.kernels.triton_gated_deltanet_programs import gated_norm_kernel, gdn_inputs_kernel

    return gdn_inputs_kernel, gated_norm_kernel


def conv_taps(rows: int, kernel: int, ancestors: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """Which rows of (window rows, then new rows) each new row's convolution reads, oldest first -> [rows, kernel]
    int32: a chain's row r reads r .. r + kernel - 1; a tree row (`ancestors` [rows, rows] bool: itself and its
    ancestors) the newest `kernel` of the window's rows and its own path's rows. Found on the device."""
    if ancestors is None:
        taps = torch.arange(rows, device=device)[:, None] + torch.arange(kernel, device=device)[None]
        return taps.to(torch.int32)
    width = kernel - 1 + rows
    taken = torch.cat(
        (torch.ones(rows, kernel - 1, dtype=torch.bool, device=device), ancestors.to(device, torch.bool)), dim=1
    )  # [rows, kernel - 1 + rows]: the window's rows and the row's path
    order = torch.arange(width, device=device).expand(rows, width)
    return torch.where(taken, order, -1).topk(kernel, dim=1).values.flip(1).to(torch.int32)


def gdn_inputs(
    proj: torch.Tensor,
    window: torch.Tensor,
    conv_weight: torch.Tensor,
    taps: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    *,
    key_heads: int,
    value_heads: int,
    key_dim: int,
    value_dim: int,
    kept: DeltaRows | None = None,
    window_out: torch.Tensor | None = None,
    count: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """proj [rows, >= channels + z + 2 * value_heads] (unit column stride), window [kernel - 1, channels],
    conv_weight [channels, 1, kernel], taps [rows, kernel] int32 -> (q, k [key_heads, rows, key_dim], v
    [value_heads, rows, value_dim], g, beta [value_heads, rows]), float32. `kept`: where to write k, v, g, beta
    and each row's convolution inputs ([rows, channels]) instead of new tensors (rows contiguous within a head);
    `window_out` [kernel - 1, channels]: the window after the live rows (`count`, a [1] device tensor, or all)."""
    rows = proj.shape[0]
    kernel = conv_weight.shape[-1]
    channels = window.shape[-1]
    device = proj.device
    q = torch.empty((key_heads, rows, key_dim), dtype=torch.float32, device=device)
    if kept is None:
        k = torch.empty_like(q)
        v = torch.empty((value_heads, rows, value_dim), dtype=torch.float32, device=device)
        g = torch.empty((value_heads, rows), dtype=torch.float32, device=device)
        beta = torch.empty_like(g)
    else:
        k, v, g, beta = kept.k, kept.v, kept.g, kept.beta
        if k.stride(1) != key_dim or v.stride(1) != value_dim or g.stride(1) != 1 or g.stride() != beta.stride():
            raise ValueError("kept rows must be contiguous within a head")
    if rows == 0:
        return q, k, v, g, beta
    conv_out = kept.conv_inputs if kept is not None else proj
    inputs, _ = _programs()
    inputs[(rows, 2 * key_heads + value_heads)](
        proj, window.contiguous(), conv_weight.contiguous(), taps.contiguous(), a_log, dt_bias,
        q, k, v, g, beta, conv_out, window_out if window_out is not None else window,
        count if count is not None else taps,
        rows, proj.stride(0), channels, key_heads, value_heads, value_heads * value_dim, key_dim**-0.5,
        k.stride(0), v.stride(0), g.stride(0), conv_out.stride(0),
        KERNEL=kernel, KEY_DIM=key_dim, VALUE_DIM=value_dim, BD=next_power_of_two(max(key_dim, value_dim)),
        KEEP_CONV=kept is not None, WINDOW=window_out is not None, COUNTED=count is not None, num_warps=4,
    )
    return q, k, v, g, beta


def gated_norm(
    read: torch.Tensor, proj: torch.Tensor, z_offset: int, weight: torch.Tensor, eps: float, dtype: torch.dtype
) -> torch.Tensor:
    """read [value_heads, rows, value_dim] float32 (contiguous), proj [rows, ...] holding z at columns z_offset ..
    -> weight * rmsnorm(read) * silu(z) as [rows, value_heads * value_dim] in `dtype`."""
    heads, rows, value_dim = read.shape
    out = torch.empty((rows, heads * value_dim), dtype=dtype, device=read.device)
    if rows:
        _, norm = _programs()
        norm[(rows, heads)](
            read, proj, weight, out, rows, proj.stride(0), z_offset, eps,
            VALUE_DIM=value_dim, BV=next_power_of_two(value_dim), num_warps=4,
        )
    return out
