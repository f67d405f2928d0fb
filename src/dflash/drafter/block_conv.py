"""DFlash2's dynamic depthwise convolution over the rows of a draft block.

Each DFlash2 drafter layer wraps its attention and its MLP in one of these. Per channel c (in group
g = c // group_size) and block row t:

    out[t, c] = sum_{o < K} (base[o, c] + dynamic[t, o, g]) * x[t - o, c]

The base kernel is learned per channel; the dynamic part is predicted from the sub-layer's (normed) input and shared
by the channels of a group. One projection gives two dynamic kernels: half 0 convolves the sub-layer input
(`prepare`), half 1 its output (`finish`). Taps never reach across a block: row 0 of a block (the anchor) reads
zeros before it. Several blocks laid end to end (training) are convolved each on its own.
"""

from __future__ import annotations

import torch
from torch import nn


class BlockDynamicConv(nn.Module):
    """Parameter names follow the published checkpoints: `base_kernel` [2, K, hidden] and
    `kernel_projection.weight` [2 * K * groups, hidden]."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int, block_size: int) -> None:
        super().__init__()
        self.kernel_size = kernel_size
        self.group_size = group_size
        self.groups = hidden_size // group_size
        self.block_size = block_size
        # a new drafter starts as the identity (tap 0 = 1, the others 0); checkpoints overwrite it
        self.base_kernel = nn.Parameter(torch.zeros(2, kernel_size, hidden_size).index_fill_(1, torch.tensor([0]), 1.0))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.groups, bias=False)

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Normed sub-layer input x [batch, rows, hidden] -> (x convolved with kernel 0, the dynamic part of
        kernel 1 [batch, rows, K, groups] for `finish`)."""
        batch, rows, _ = x.shape
        dynamic = self.kernel_projection(x).view(batch, rows, 2, self.kernel_size, self.groups)
        return self.convolve(x, dynamic[:, :, 0], self.base_kernel[0]), dynamic[:, :, 1]

    def finish(self, y: torch.Tensor, dynamic: torch.Tensor) -> torch.Tensor:
        """Sub-layer output y [batch, rows, hidden] convolved with kernel 1 (its dynamic part from `prepare`)."""
        return self.convolve(y, dynamic, self.base_kernel[1])

    def convolve(self, x: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
        """x [batch, rows, hidden]; dynamic [batch, rows, K, groups]; base [K, hidden] -> [batch, rows, hidden].

        `rows` is a whole number of blocks (one at inference)."""
        batch, rows, hidden = x.shape
        block = self.block_size if rows % self.block_size == 0 else rows
        blocks = x.view(batch, rows // block, block, hidden)  # [batch, blocks, B, hidden]
        out = torch.zeros_like(x)
        for offset in range(min(self.kernel_size, block)):
            # row t reads row t - offset of its own block; the first `offset` rows of a block read zeros
            shifted = torch.zeros_like(blocks)
            shifted[:, :, offset:] = blocks[:, :, : block - offset]
            taps = base[offset].to(x.dtype).view(self.groups, self.group_size) + dynamic[:, :, offset, :, None]
            # taps: [batch, rows, groups, group_size], one weight per row and channel
            out = out + taps.reshape(batch, rows, hidden) * shifted.view(batch, rows, hidden)
        return out
