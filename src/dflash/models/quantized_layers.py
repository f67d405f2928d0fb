"""`nn.Linear` and `nn.Embedding` stand-ins whose weights stay GGUF blocks, computed by the CPU kernel.

`QuantizedLinear` computes y = x @ W^T (+ bias) for float32 x of any leading shape; every output element
takes the same path in the same order whatever the number of rows (see `kernels/quant_matmul.cpp`), so a
row of a 16-token verification is bitwise equal to the same row decoded alone. `QuantizedEmbedding` looks
rows up by dequantising just those rows (bit-identical to the dense loader's values).

Both keep an empty float32 `weight` buffer: code that asks `module.weight.dtype` or `.device` for the
model's compute dtype and device (KV-cache allocation, the decoding loops) keeps working. The weights
themselves are in the `blocks` buffer; neither buffer is part of the state dict.

`QuantizedLinear.use_products("amx")` moves a matrix to the AMX kernel (bf16 products, float32 sums, batch
invariant as well), `use_products("int8")` to the integer kernel (inputs quantised to int8 blocks, batch
invariant as well); `dflash.models.cpu_matmul` chooses for a whole model. The float32 and AMX kernels read Q4_1
and Q8_0 only: a matrix in Q4_0, Q4_K, Q5_K or Q6_K starts on int8x2 products and refuses the other two.
On the int8 kernels, where the CPU's products run on the AVX-512 VNNI vector path, a Q4_0, Q4_1 or Q8_0 matrix is
kept as weight panels instead of GGUF rows (`kernels/int8_panels.h`: 16 rows interleaved, the same bytes moved; its
products bitwise the rows', at 1.2-1.6x the speed); `row_blocks` gives its GGUF rows back either way, and a tied
`QuantizedEmbedding` looks its rows up in the head's panels (`share_table`) rather than keep a second copy.
`QuantizedStack` holds a fused projection whose parts are in different formats (Q4_K_M files store some layers'
attn_v in Q6_K beside attn_q and attn_k in Q4_K): one product per format, outputs side by side.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar, cast

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from torch import nn

from dflash import environment
from dflash.errors import ModelLoadError
from dflash.kernels.build import (
    AmxKernel,
    Int8Kernel,
    QuantKernel,
    load_amx_kernel,
    load_int8_kernel,
    load_quant_kernel,
)
from dflash.models.quantized_weights import (
    QuantizedMatrix,
    float_kernels_read,
    join_formats,
    require_cpu_readable,
)

# the formats weight panels hold (`kernels/int8_panels.h`)
PANEL_FORMATS = frozenset({int(GGMLQuantizationType.Q4_0), int(GGMLQuantizationType.Q4_1), int(GGMLQuantizationType.Q8_0)})

__all__ = ["PANEL_FORMATS", "QuantizedEmbedding", "QuantizedLinear", "QuantizedStack", "linear_of_parts", "uses_quantized_weights"]


class QuantizedLinear(nn.Module):
    """y[..., out] = x[..., in] @ W[out, in]^T (+ bias), W held as GGUF blocks (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K)."""

    blocks: torch.Tensor
    weight: torch.Tensor
    # counts `use_products` calls: descriptions of layers that name their products kind are rebuilt after one
    # (`dflash.models.native_stack`)
    products_changes: ClassVar[int] = 0

    def __init__(self, matrix: QuantizedMatrix, bias: bool = False) -> None:
        super().__init__()
        require_cpu_readable(matrix.qtype)
        self.in_features = matrix.columns
        self.out_features = matrix.rows
        self.qtype = int(matrix.qtype)
        self.products = "float32"
        self.panels = False  # `blocks` holds weight panels (int8 kernels), not GGUF rows
        self._kernel: QuantKernel | AmxKernel | Int8Kernel
        if float_kernels_read(matrix.qtype):
            self._kernel = load_quant_kernel()
        else:  # only the int8 kernel reads it
            self.products, self._kernel = "int8x2", load_int8_kernel()
        self.register_buffer("blocks", matrix.blocks, persistent=False)
        self.register_buffer("weight", torch.empty(0, dtype=torch.float32), persistent=False)
        self.bias = nn.Parameter(torch.zeros(matrix.rows)) if bias else None

    def use_products(self, products: str) -> None:
        """float32 (the float32 kernel), amx (bf16 products on AMX tiles), int8 (int8 inputs, integer dot
        products) or int8x2 (inputs in two 8-bit parts, two integer dot products); see `dflash.models.cpu_matmul`.
        float32 and amx read Q4_1 and Q8_0 only: `ModelLoadError` for a matrix in another format."""
        qtype = GGMLQuantizationType(self.qtype)
        if products in ("amx", "float32") and not float_kernels_read(qtype):
            raise ModelLoadError(
                f"--cpu-matmul {products} reads Q4_1 and Q8_0 matrices only, not {qtype.name}; "
                "use --cpu-matmul int8x2 (or int8, auto)"
            )
        if products == "amx":
            self._kernel = load_amx_kernel()
        elif products in ("int8", "int8x2"):
            self._kernel = load_int8_kernel()
        elif products == "float32":
            self._kernel = load_quant_kernel()
        else:
            raise ValueError(f"unknown products {products!r}")
        self.products = products
        self._arrange(self._panels_here())
        QuantizedLinear.products_changes += 1

    def row_blocks(self, ids: torch.Tensor | None = None) -> torch.Tensor:
        """The GGUF rows `ids` (all by default) of the matrix: [rows, bytes per row] uint8, whatever its layout."""
        if not self.panels:
            return self.blocks if ids is None else self.blocks.index_select(0, ids)
        if ids is None:
            ids = torch.arange(self.out_features)
        return cast(Int8Kernel, self._kernel).panel_rows(self.blocks, self.qtype, ids)

    def _panels_here(self) -> bool:
        """Whether this matrix's products read weight panels: int8 products on the AVX-512 VNNI vector path (not
        where AMX tiles take several rows: they read GGUF rows) of a format panels hold."""
        if self.products not in ("int8", "int8x2") or not environment.cpu_panels_enabled():
            return False
        kernel = cast(Int8Kernel, self._kernel)
        return self.qtype in PANEL_FORMATS and kernel.panels_available() and not kernel.has_tiles()

    def _arrange(self, panels: bool) -> None:
        """Keep `blocks` as weight panels or as GGUF rows (moved, not copied: one layout is kept)."""
        if panels == self.panels:
            return
        if panels:
            self.blocks = load_int8_kernel().to_panels(self.blocks, self.qtype)
        else:
            self.blocks = load_int8_kernel().panel_rows(self.blocks, self.qtype, torch.arange(self.out_features))
        self.panels = panels
        QuantizedLinear.products_changes += 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        rows = x.reshape(-1, self.in_features)
        if self.panels:
            parts = 2 if self.products == "int8x2" else 1
            y = cast(Int8Kernel, self._kernel).panel_matmul(rows, self.blocks, self.qtype, self.out_features, parts)
        elif self.products == "int8x2":
            y = cast(Int8Kernel, self._kernel).matmul(rows, self.blocks, self.qtype, True, 2)  # [rows, out]
        else:
            y = self._kernel.matmul(rows, self.blocks, self.qtype)  # [rows, out]
        if self.bias is not None:
            y = y + self.bias
        return y.view(*lead, self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, qtype={self.qtype}, "
                f"products={self.products}{', panels' if self.panels else ''}")


class QuantizedStack(nn.Module):
    """y[..., out] = x[..., in] @ [W_1; W_2; ...]^T (+ bias) for row blocks W_i in different formats: one
    `QuantizedLinear` per block (so `cpu_matmul.use_cpu_matmul` reaches each), outputs side by side. Every output
    element is the product of its own row, so the stack is batch invariant as its parts are."""

    weight: torch.Tensor

    def __init__(self, parts: Sequence[QuantizedMatrix], bias: bool = False) -> None:
        super().__init__()
        self.parts = nn.ModuleList(QuantizedLinear(part) for part in parts)
        self.in_features = parts[0].columns
        self.out_features = sum(part.rows for part in parts)
        self.register_buffer("weight", torch.empty(0, dtype=torch.float32), persistent=False)
        self.bias = nn.Parameter(torch.zeros(self.out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.cat([part(x) for part in self.parts], dim=-1)  # [..., out]
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        formats = "+".join(GGMLQuantizationType(cast(QuantizedLinear, p).qtype).name for p in self.parts)
        return f"in_features={self.in_features}, out_features={self.out_features}, formats={formats}"


def linear_of_parts(parts: Sequence[QuantizedMatrix], bias: bool = False) -> QuantizedLinear | QuantizedStack:
    """The rows of `parts` (a fused projection) as one module: one `QuantizedLinear` where consecutive parts share
    a format, else a `QuantizedStack` of one matrix per run of a format."""
    joined = join_formats(parts)
    return QuantizedLinear(joined[0], bias=bias) if len(joined) == 1 else QuantizedStack(joined, bias=bias)


class QuantizedEmbedding(nn.Module):
    """ids[...] -> rows[..., dim] of a GGUF table, dequantised on lookup (Q4_1 / Q8_0 by the float32 kernel; the
    formats it does not read by `gguf`'s dequantiser, the dense loader's own)."""

    blocks: torch.Tensor
    weight: torch.Tensor

    def __init__(self, matrix: QuantizedMatrix) -> None:
        super().__init__()
        require_cpu_readable(matrix.qtype)
        self.num_embeddings = matrix.rows
        self.embedding_dim = matrix.columns
        self.qtype = int(matrix.qtype)
        self._kernel = load_quant_kernel() if float_kernels_read(matrix.qtype) else None
        self.panels = False  # `blocks` are a tied head's weight panels (`share_table`)
        self.register_buffer("blocks", matrix.blocks, persistent=False)
        self.register_buffer("weight", torch.empty(0, dtype=torch.float32), persistent=False)

    def share_table(self, head: QuantizedLinear) -> None:
        """Read the rows from a tied head's blocks in whatever layout it keeps them (one copy of the table)."""
        if (head.qtype, head.out_features, head.in_features) != (self.qtype, self.num_embeddings, self.embedding_dim):
            raise ValueError("the head does not hold this table")
        self.blocks, self.panels = head.blocks, head.panels

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids = input_ids.reshape(-1)
        if self.panels:
            rows = load_int8_kernel().panel_rows(self.blocks, self.qtype, ids)  # [n, bytes per row]
        else:
            rows = self.blocks.index_select(0, ids)  # [n, bytes per row]
        if self._kernel is not None:
            values = self._kernel.dequantize(rows, self.qtype, self.embedding_dim)  # [n, dim]
        else:
            dequantized = dequantize(rows.numpy(), GGMLQuantizationType(self.qtype))  # [n, dim] float32
            values = torch.from_numpy(np.ascontiguousarray(dequantized, dtype=np.float32))
        return values.view(*input_ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, qtype={self.qtype}"


def uses_quantized_weights(model: nn.Module) -> bool:
    return any(isinstance(m, (QuantizedLinear, QuantizedEmbedding)) for m in model.modules())
