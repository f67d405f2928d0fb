"""Products with a GPU matrix held quantized in parts (a fused projection's segments), each part either 4-bit words
(`NibbleMatrix`, `triton_gguf_int8`) or GGUF blocks (`triton_gguf_matmul`): y = x @ W^T, one output slice per part.

Up to 64 rows each part takes its own programs into its columns of the output; the inputs' rounding for the
word parts' integer products is done once per call and shared. More rows (prefill chunks) dequantise every part
into one temporary matrix for cuBLAS.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType

from dflash.kernels.gguf_nibbles import NibbleMatrix
from dflash.kernels.triton_gguf_int8 import (
    QuantizedInput,
    integer_rows,
    nibble_dequantize,
    nibble_product,
    quantize_input,
)
from dflash.kernels.triton_gguf_matmul import MAX_ROWS, gguf_dequantize, gguf_matmul

__all__ = ["QuantizedPart", "dequantize_part", "part_rows", "quantized_linear"]

QuantizedPart = NibbleMatrix | tuple[torch.Tensor, GGMLQuantizationType]  # words, or (blocks [n, row bytes], format)


def part_rows(part: QuantizedPart) -> int:
    return part.n if isinstance(part, NibbleMatrix) else int(part[0].shape[0])


def dequantize_part(
    part: QuantizedPart, k: int, dtype: torch.dtype, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The part's weights [n, k] in `dtype`, into `out` when given."""
    if isinstance(part, NibbleMatrix):
        return nibble_dequantize(part, dtype, out=out)
    return gguf_dequantize(part[0], part[1], k, dtype, out=out)


def rounds_input(parts: Sequence[QuantizedPart], rows: int, device: torch.device) -> bool:
    """Whether `quantized_linear` multiplies `rows` rows by these parts through their 8-bit rounding
    (`QuantizedInput`): a fused program that produces the rows can then round them too (`rounded=`)."""
    return 0 < rows <= integer_rows(device) and any(isinstance(part, NibbleMatrix) for part in parts)


def quantized_linear(
    x: torch.Tensor, parts: Sequence[QuantizedPart], bias: torch.Tensor | None = None,
    rounded: QuantizedInput | None = None,
) -> torch.Tensor:
    """F.linear(x, W, bias) for x [rows, k], W the rows of `parts` one after another. `rounded`: x's
    `quantize_input`, already made by the program that produced x (where `rounds_input`)."""
    rows, k = x.shape
    n = sum(part_rows(part) for part in parts)
    if rows == 0:
        return x.new_zeros((0, n)) if bias is None else x.new_zeros((0, n)) + bias
    if rows <= MAX_ROWS:
        x = x.contiguous()
        out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
        shared = None
        if rounds_input(parts, rows, x.device):
            shared = rounded if rounded is not None else quantize_input(x)
        start = 0
        for part in parts:
            columns = out[:, start : start + part_rows(part)]
            if isinstance(part, NibbleMatrix):
                nibble_product(x, part, columns, quantized=shared)
            else:
                gguf_matmul(x, part[0], part[1], out=columns)
            start += part_rows(part)
        return out if bias is None else out.add_(bias)
    weight = torch.empty((n, k), dtype=x.dtype, device=x.device)  # freed on return
    start = 0
    for part in parts:
        dequantize_part(part, k, x.dtype, out=weight[start : start + part_rows(part)])
        start += part_rows(part)
    return F.linear(x, weight, bias)
