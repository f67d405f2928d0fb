"""Weight matrices kept as GGUF blocks, and the checkpoint that carries them.

A `QuantizedMatrix` is a [rows, columns] matrix stored row by row as the GGUF file stores it: each row is
columns / `block values` blocks of `block bytes` (`STORED_BLOCKS`: 32-value blocks for Q4_0, Q4_1 and Q8_0,
256-value super-blocks for Q4_K, Q5_K and Q6_K). Rows are independent in all of them, so permuting rows (llama's
Q/K un-permutation) and stacking matrices row-wise (fused q/k/v, gate/up) work on the bytes.

Who reads which formats: on the CPU the int8 kernel every stored format (`is_supported_type`) and the float32 and
bf16 (AMX) kernels Q4_1 and Q8_0 (`float_kernels_read`, `BLOCK_BYTES`); the GPU programs
(`dflash.kernels.triton_gguf_matmul`) every stored format (`is_gpu_supported_type`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from gguf import GGMLQuantizationType

from dflash.errors import ModelLoadError
from dflash.models.checkpoint import Checkpoint

__all__ = [
    "BLOCK_BYTES",
    "BLOCK_VALUES",
    "STORED_BLOCKS",
    "QuantizedCheckpoint",
    "QuantizedMatrix",
    "float_kernels_read",
    "is_gpu_supported_type",
    "is_supported_type",
    "join_formats",
    "require_cpu_readable",
]

BLOCK_VALUES = 32
# Bytes per block of 32 weights, for the formats the float32 and bf16 CPU kernels read.
BLOCK_BYTES: dict[GGMLQuantizationType, int] = {
    GGMLQuantizationType.Q4_1: 20,  # fp16 d, fp16 m, 16 bytes of nibbles: w = d * q + m
    GGMLQuantizationType.Q8_0: 34,  # fp16 d, 32 int8: w = d * q
}

# Every format a `QuantizedMatrix` holds -> (values per block, bytes per block), llama.cpp's layouts.
STORED_BLOCKS: dict[GGMLQuantizationType, tuple[int, int]] = {
    GGMLQuantizationType.Q4_0: (32, 18),  # fp16 d, 16 bytes of nibbles: w = d * (q - 8)
    GGMLQuantizationType.Q4_1: (32, 20),
    GGMLQuantizationType.Q8_0: (32, 34),
    GGMLQuantizationType.Q4_K: (256, 144),  # fp16 d, dmin, 12 bytes of 6-bit scales/mins, 128 of nibbles
    GGMLQuantizationType.Q5_K: (256, 176),  # as Q4_K, plus 32 bytes of fifth bits before the nibbles
    GGMLQuantizationType.Q6_K: (256, 210),  # 128 bytes low nibbles, 64 of high 2 bits, 16 int8 scales, fp16 d
}


def is_supported_type(qtype: GGMLQuantizationType) -> bool:
    """Whether a CPU kernel reads `qtype` (the int8 kernel reads every stored format)."""
    return qtype in STORED_BLOCKS


def float_kernels_read(qtype: GGMLQuantizationType) -> bool:
    """Whether the float32 and bf16 (AMX) CPU kernels read `qtype` (Q4_1, Q8_0); the others need the int8 kernel."""
    return qtype in BLOCK_BYTES


def is_gpu_supported_type(qtype: GGMLQuantizationType) -> bool:
    """Whether the GPU programs (`dflash.kernels.triton_gguf_matmul`) read `qtype`: every stored format."""
    return qtype in STORED_BLOCKS


def require_cpu_readable(qtype: GGMLQuantizationType) -> None:
    """Raise `ModelLoadError` unless a CPU kernel reads `qtype`."""
    if not is_supported_type(qtype):
        kept = ", ".join(t.name for t in STORED_BLOCKS)
        raise ModelLoadError(f"quantized weights in {qtype.name} are not supported ({kept} are)")


@dataclass(frozen=True)
class QuantizedMatrix:
    """blocks: uint8 [rows, columns / block values * block bytes], contiguous (on the CPU when loaded; a GPU
    module moves them to its device)."""

    blocks: torch.Tensor
    qtype: GGMLQuantizationType
    columns: int

    def __post_init__(self) -> None:
        if self.qtype not in STORED_BLOCKS:
            kept = ", ".join(t.name for t in STORED_BLOCKS)
            raise ModelLoadError(f"quantized weights in {self.qtype.name} are not supported ({kept} are)")
        block_values, block_bytes = STORED_BLOCKS[self.qtype]
        if self.columns % block_values:
            raise ModelLoadError(f"rows of {self.columns} values are not whole blocks of {block_values}")
        expected = self.columns // block_values * block_bytes
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


def join_formats(parts: Sequence[QuantizedMatrix]) -> list[QuantizedMatrix]:
    """Consecutive parts of one format stacked into one matrix (a fused projection whose parts a file stores in
    different formats keeps one matrix per run); the parts must share their row length."""
    if any(part.columns != parts[0].columns for part in parts):
        raise ModelLoadError(f"fused parts have rows of {sorted({p.columns for p in parts})} values")
    joined: list[list[QuantizedMatrix]] = []
    for part in parts:
        if joined and joined[-1][0].qtype == part.qtype:
            joined[-1].append(part)
        else:
            joined.append([part])
    return [run[0] if len(run) == 1 else QuantizedMatrix.stack_rows(run, "a fused projection") for run in joined]


@dataclass
class QuantizedCheckpoint(Checkpoint):
    """A checkpoint whose matrices stay quantized: `matrices` holds every 2-D weight under its Hugging Face
    name; `weights` holds the rest (norms, biases, a hybrid's convolution) as dense tensors. `input_orders`: for a
    matrix whose stored columns are not in the model's input order (a hybrid's `out_proj`), the input feature
    each stored column multiplies, [columns] long."""

    matrices: dict[str, QuantizedMatrix] = field(default_factory=dict)
    input_orders: dict[str, torch.Tensor] = field(default_factory=dict)

    def type_counts(self) -> dict[str, int]:
        """Matrix formats -> how many matrices use them."""
        counts: dict[str, int] = {}
        for matrix in self.matrices.values():
            counts[matrix.qtype.name] = counts.get(matrix.qtype.name, 0) + 1
        return counts

    def matrix_formats(self) -> frozenset[GGMLQuantizationType]:
        """The formats of the matrices."""
        return frozenset(matrix.qtype for matrix in self.matrices.values())

    def parameter_count(self) -> int:
        return sum(m.rows * m.columns for m in self.matrices.values()) + sum(t.numel() for t in self.weights.values())
