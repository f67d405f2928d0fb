"""`nn.Linear` and `nn.Embedding` stand-ins whose weights stay GGUF blocks on a CUDA device
(`dflash.kernels.triton_gguf_matmul`): the GPU counterparts of `quantized_layers.py`'s CPU modules.

`GGUFLinear` computes y = x @ dequant(W)^T (+ bias) for 16-bit x of any leading shape: up to 64 rows through the
block program (W read once as its 4.5 to 8.5 bits per weight), more rows by dequantising W into a temporary bf16
matrix for cuBLAS. A fused projection may mix formats (a Q4_K_M file's q/k in Q4_K, v in Q6_K): one product per
run of parts in one format, each into its own output columns. `GGUFEmbedding` keeps the table quantized too and dequantises only the looked-up rows (a
Qwen3-8B's table is 0.35 GB as Q4_K against 1.2 GB in bf16).

Both keep an empty `weight` buffer in the compute dtype on the device, so code that asks `module.weight.dtype` or
`.device` keeps working; the blocks are the `blocks` buffer; neither is part of the state dict.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from gguf import GGMLQuantizationType
from torch import nn

from dflash.errors import ModelLoadError
from dflash.kernels.triton_gguf_matmul import gguf_dequantize, gguf_linear
from dflash.models.quantized_weights import QuantizedMatrix, is_gpu_supported_type

__all__ = ["GGUFEmbedding", "GGUFLinear", "uses_gpu_quantized_weights"]


def _device_blocks(matrix: QuantizedMatrix, device: torch.device) -> torch.Tensor:
    if not is_gpu_supported_type(matrix.qtype):
        raise ModelLoadError(f"the GPU programs do not read {matrix.qtype.name} blocks")
    return matrix.blocks.to(device)  # no copy when the blocks are there already (a tied head shares the table's)


class GGUFLinear(nn.Module):
    """y[..., out] = x[..., in] @ dequant(W[out, in])^T (+ bias), W held as GGUF blocks on the device: one matrix,
    or the rows of several (a fused q/k/v or gate/up) whose formats may differ. Consecutive parts of one format are
    joined into one block buffer (`blocks`, then `blocks_1`, ...), so a uniform fused matrix is one product."""

    weight: torch.Tensor

    def __init__(
        self,
        parts: QuantizedMatrix | Sequence[QuantizedMatrix],
        device: torch.device | str,
        dtype: torch.dtype,
        bias: bool = False,
    ) -> None:
        super().__init__()
        device = torch.device(device)
        segments = _join_formats([parts] if isinstance(parts, QuantizedMatrix) else list(parts))
        self.in_features = segments[0].columns
        self.out_features = sum(segment.rows for segment in segments)
        self.formats = [GGMLQuantizationType(segment.qtype) for segment in segments]
        self._block_names = [f"blocks_{i}" if i else "blocks" for i in range(len(segments))]
        for name, segment in zip(self._block_names, segments, strict=True):
            self.register_buffer(name, _device_blocks(segment, device), persistent=False)
        self.register_buffer("weight", torch.empty(0, dtype=dtype, device=device), persistent=False)
        self.bias = nn.Parameter(torch.zeros(self.out_features, dtype=dtype, device=device)) if bias else None

    @property
    def parts(self) -> list[tuple[torch.Tensor, GGMLQuantizationType]]:
        """(blocks [rows, row bytes], format) of each segment, in output order."""
        return [(getattr(self, name), qtype) for name, qtype in zip(self._block_names, self.formats, strict=True)]

    @property
    def qtype(self) -> GGMLQuantizationType:
        """The format of a single-format matrix."""
        if len(self.formats) != 1:
            raise ValueError(f"this matrix has parts in {', '.join(t.name for t in self.formats)}")
        return self.formats[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        y = gguf_linear(x.reshape(-1, self.in_features), self.parts, self.bias)  # [rows, out]
        return y.view(*lead, self.out_features)

    def dequantized(self) -> torch.Tensor:
        """The weights as a dense [out, in] matrix in the compute dtype."""
        return torch.cat([gguf_dequantize(b, t, self.in_features, self.weight.dtype) for b, t in self.parts])

    def rows(self, ids: torch.Tensor) -> GGUFLinear:
        """A bias-free module over the rows `ids` of a single-format W (an LM head cut to a token shortlist)."""
        blocks = self.parts[0][0].index_select(0, ids.to(self.weight.device))
        return GGUFLinear(QuantizedMatrix(blocks, self.qtype, self.in_features), blocks.device, self.weight.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"formats={'+'.join(t.name for t in self.formats)}")


def _join_formats(parts: list[QuantizedMatrix]) -> list[QuantizedMatrix]:
    """Consecutive parts of one format stacked into one matrix; the parts must share their row length."""
    if any(part.columns != parts[0].columns for part in parts):
        raise ModelLoadError(f"fused parts have rows of {sorted({p.columns for p in parts})} values")
    joined: list[list[QuantizedMatrix]] = []
    for part in parts:
        if joined and joined[-1][0].qtype == part.qtype:
            joined[-1].append(part)
        else:
            joined.append([part])
    return [run[0] if len(run) == 1 else QuantizedMatrix.stack_rows(run, "a fused projection") for run in joined]


class GGUFEmbedding(nn.Module):
    """ids[...] -> rows[..., dim] of a GGUF table on the device, dequantised on lookup in the compute dtype."""

    blocks: torch.Tensor
    weight: torch.Tensor

    def __init__(self, matrix: QuantizedMatrix, device: torch.device | str, dtype: torch.dtype) -> None:
        super().__init__()
        device = torch.device(device)
        self.num_embeddings = matrix.rows
        self.embedding_dim = matrix.columns
        self.qtype = GGMLQuantizationType(matrix.qtype)
        self.register_buffer("blocks", _device_blocks(matrix, device), persistent=False)
        self.register_buffer("weight", torch.empty(0, dtype=dtype, device=device), persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = self.blocks.index_select(0, input_ids.reshape(-1))  # [ids, bytes per row]
        values = gguf_dequantize(rows, self.qtype, self.embedding_dim, self.weight.dtype)  # [ids, dim]
        return values.view(*input_ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, qtype={self.qtype.name}"


def uses_gpu_quantized_weights(model: nn.Module) -> bool:
    return any(isinstance(m, (GGUFLinear, GGUFEmbedding)) for m in model.modules())
