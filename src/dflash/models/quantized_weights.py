"""Weight matrices kept as GGUF blocks (Q4_1, Q8_0), and the checkpoint that carries them.

A `QuantizedMatrix` is a [rows, columns] matrix stored row by row as the GGUF file stores it: each row is
columns / 32 blocks of `BLOCK_BYTES[qtype]` bytes. Rows are independent in these formats, so permuting
rows (llama's Q/K un-permutation) and stacking matrices row-wise (fused q/k/v, gate/up) work on the bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from gguf import GGMLQuantizationType

from dflash.errors import ModelLoadError
from dflash.models.checkpoint import Checkpoint

__all__ = ["BLOCK_BYTES", "BLOCK_VALUES", "QuantizedCheckpoint", "QuantizedMatrix", "is_supported_type"]

BLOCK_VALUES = 32
# Bytes per block of 32 weights, for the formats the CPU kernel reads.
BLOCK_BYTES: dict[GGMLQuantizationType, int] = {
    GGMLQuantizationType.Q4_1: 20,  # fp16 d, fp16 m, 16 bytes of nibbles: w = d * q + m
    GGMLQuantizationType.Q8_0: 34,  # fp16 d, 32 int8: w = d * q
}


def is_supported_type(qtype: GGMLQuantizationType) -> bool:
    return qtype in BLOCK_BYTES


@dataclass(frozen=True)
class QuantizedMatrix:
    """blocks: uint8 [rows, columns / 32 * block bytes], contiguous, on the CPU."""

    blocks: torch.Tensor
    qtype: GGMLQuantizationType
    columns: int

    def __post_init__(self) -> None:
        if not is_supported_type(self.qtype):
            raise ModelLoadError(f"quantized weights in {self.qtype.name} are not supported (Q4_1, Q8_0 are)")
        if self.columns % BLOCK_VALUES:
            raise ModelLoadError(f"rows of {self.columns} values are not whole blocks of {BLOCK_VALUES}")
        expected = self.columns // BLOCK_VALUES * BLOCK_BYTES[self.qtype]
        if self.blocks.dtype != torch.uint8 or self.blocks.dim() != 2 or self.blocks.shape[1] != expected:
            raise ModelLoadError(
                f"{self.qtype.name} blocks for rows of {self.columns} values must be uint8 [rows, {expected}], "
                f"got {self.blocks.dtype} {list(self.blocks.shape)}"
            )
        if not self.blocks.is_contiguous():
            object.__setattr__(self, "blocks", self.blocks.contiguous())

    @property
    def rows(self) -> int:
        return int(self.blocks.shape[0])

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows, self.columns

    @staticmethod
    def stack_rows(parts: Sequence[QuantizedMatrix], what: str) -> QuantizedMatrix:
        """The matrices' rows one after another (parts must share format and row length)."""
        first = parts[0]
        for part in parts[1:]:
            if part.qtype != first.qtype or part.columns != first.columns:
                raise ModelLoadError(
                    f"cannot fuse {what}: its parts are {first.qtype.name} x {first.columns} and "
                    f"{part.qtype.name} x {part.columns}"
                )
        return QuantizedMatrix(torch.cat([p.blocks for p in parts], dim=0), first.qtype, first.columns)


@dataclass
class QuantizedCheckpoint(Checkpoint):
    """A checkpoint whose matrices stay quantized: `matrices` holds every 2-D weight under its Hugging Face
    name; `weights` holds the rest (norms, biases) as dense tensors."""

    matrices: dict[str, QuantizedMatrix] = field(default_factory=dict)

    def type_counts(self) -> dict[str, int]:
        """Matrix formats -> how many matrices use them."""
        counts: dict[str, int] = {}
        for matrix in self.matrices.values():
            counts[matrix.qtype.name] = counts.get(matrix.qtype.name, 0) + 1
        return counts

    def parameter_count(self) -> int:
        return sum(m.rows * m.columns for m in self.matrices.values()) + sum(t.numel() for t in self.weights.values())
