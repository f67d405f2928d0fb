"""The drafter's projections as Q8_0 blocks for the quantized CPU kernel.

On the CPU the drafter's dense float32 matrices (62 MB for the default model's drafter) are read from memory
every round, and that read, not arithmetic, sets the round's time. Q8_0 (one fp16 scale per 32 int8 weights)
cuts them to 17 MB, small enough to stay in the last-level cache between rounds, and the kernel multiplies
them without dequantising to memory. Drafts only propose tokens: the target verifies every one, so rounding
the drafter's weights can change how many drafts are accepted, never what is generated.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize
from torch import nn

from dflash.drafter.model import DFlashDrafter
from dflash.models.quantized_layers import QuantizedLinear
from dflash.models.quantized_weights import BLOCK_VALUES, QuantizedMatrix

__all__ = ["q8_0_matrix", "quantize_drafter"]


def q8_0_matrix(weight: torch.Tensor) -> QuantizedMatrix:
    """weight: [rows, columns] (columns a multiple of 32) -> its Q8_0 blocks (the GGUF reference quantiser)."""
    values = weight.detach().to(device="cpu", dtype=torch.float32).numpy()
    blocks = quantize(np.ascontiguousarray(values), GGMLQuantizationType.Q8_0)  # uint8 [rows, columns / 32 * 34]
    return QuantizedMatrix(torch.from_numpy(np.ascontiguousarray(blocks)), GGMLQuantizationType.Q8_0, values.shape[1])


def stacked_matrices(matrices: list[nn.Module]) -> QuantizedLinear:
    """Quantized matrices of one format and input width -> one whose output is theirs side by side."""
    linear = [m for m in matrices if isinstance(m, QuantizedLinear) and m.bias is None]
    if len(linear) != len(matrices):
        raise ValueError("only bias-free quantized matrices stack")
    parts = [QuantizedMatrix(m.blocks, GGMLQuantizationType(m.qtype), m.in_features) for m in linear]
    return QuantizedLinear(QuantizedMatrix.stack_rows(parts, "the drafter's projections"))


def quantize_drafter(drafter: DFlashDrafter) -> int:
    """Replace every bias-free `nn.Linear` of a float32 CPU drafter whose input width is a multiple of 32 by a
    Q8_0 `QuantizedLinear`, in place, and stack the projections that read the same input into one product each
    (`DFlashDrafter.fuse_projections`). Returns how many matrices were replaced."""
    if drafter.fc.weight.device.type != "cpu" or drafter.fc.weight.dtype != torch.float32:
        raise ValueError("only a float32 drafter on the CPU can run on the quantized kernel")
    replaced = 0
    for parent in list(drafter.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and child.bias is None and child.in_features % BLOCK_VALUES == 0:
                setattr(parent, name, QuantizedLinear(q8_0_matrix(child.weight)))
                replaced += 1
    drafter.fuse_projections(stacked_matrices)  # (a plan of the native layers is rebuilt: `layers_changed`)
    return replaced
