"""GGUF block formats the quantized code does not read, rewritten at load into one it reads, without loss.

Q5_0 (llama.cpp's layout, 22 bytes per 32 weights: fp16 d, 4 bytes holding each weight's fifth bit, 16 bytes of
low nibbles; w = d * (q - 16) with q in 0..31) becomes Q8_0 (fp16 d, 32 int8: w = d * q): q - 16 lies in -16..15, so
every weight keeps its exact value. Q4_K_M files use Q5_0 for some matrices (Gemma 3's attention keys and values).
The matrix grows from 22 to 34 bytes per block.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType

__all__ = ["TRANSCODED", "effective_format", "transcode_blocks"]

# format in the file -> format the matrix is kept in
TRANSCODED: dict[GGMLQuantizationType, GGMLQuantizationType] = {
    GGMLQuantizationType.Q5_0: GGMLQuantizationType.Q8_0,
}
_Q5_0_BYTES, _Q8_0_BYTES, _VALUES = 22, 34, 32


def effective_format(qtype: GGMLQuantizationType) -> GGMLQuantizationType:
    """The format a matrix stored as `qtype` is kept in after loading."""
    return TRANSCODED.get(qtype, qtype)


def transcode_blocks(blocks: torch.Tensor, qtype: GGMLQuantizationType) -> torch.Tensor:
    """Rows of `qtype` blocks (uint8 [rows, bytes]) -> the same rows in `effective_format(qtype)`."""
    if qtype != GGMLQuantizationType.Q5_0:
        return blocks
    rows = blocks.shape[0]
    raw = blocks.numpy().reshape(rows, -1, _Q5_0_BYTES)  # [rows, blocks, 22]
    scale = raw[..., :2]  # fp16 d, kept as its bytes
    high = raw[..., 2:6].copy().view("<u4")  # [rows, blocks, 1]: bit j is weight j's fifth bit
    low = raw[..., 6:]  # [rows, blocks, 16]: weight j's low nibble in byte j (j < 16) or j - 16 (high nibble)
    nibbles = np.concatenate((low & 0x0F, low >> 4), axis=-1).astype(np.int16)  # [rows, blocks, 32]
    fifth = ((high >> np.arange(_VALUES, dtype=np.uint32)) & 1).astype(np.int16)  # [rows, blocks, 32]
    values = (nibbles | (fifth << 4)) - 16  # -16..15
    out = np.empty((rows, raw.shape[1], _Q8_0_BYTES), dtype=np.uint8)
    out[..., :2] = scale
    out[..., 2:] = values.astype(np.int8).view(np.uint8)
    return torch.from_numpy(out.reshape(rows, -1))
