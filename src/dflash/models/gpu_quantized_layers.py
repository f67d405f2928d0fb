"""`nn.Linear` and `nn.Embedding` stand-ins whose weights stay GGUF blocks on a CUDA device
(`dflash.kernels.triton_gguf_matmul`): the GPU counterparts of `quantized_layers.py`'s CPU modules.

`GGUFLinear` computes y = x @ dequant(W)^T (+ bias) for 16-bit x of any leading shape: up to 64 rows through the
word or block programs (W read once as its 4.5 to 8.5 bits per weight; `dflash.kernels.gpu_quantized_products`),
more rows by dequantising W into a temporary bf16 matrix for cuBLAS. A fused projection may mix formats (a Q4_K_M file's q/k in Q4_K, v in Q6_K): one product per
run of parts in one format, each into its own output columns. `GGUFEmbedding` keeps the table quantized too and dequantises only the looked-up rows (a
Qwen3-8B's table is 0.35 GB as Q4_K against 1.2 GB in bf16).

Both keep an empty `weight` buffer in the compute dtype on the device, so code that asks `module.weight.dtype` or
`.device` keeps working; the weights are the `words`/`blocks` buffers; none is part of the state dict.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch
from gguf import GGMLQuantizationType
from torch import nn

from dflash.errors import ModelLoadError
from dflash.kernels.gguf_nibbles import NIBBLE_FORMATS, NibbleMatrix, nibble_matrix, select_rows
from dflash.kernels.gpu_quantized_products import (
    QuantizedPart,
    dequantize_part,
    quantized_linear,
    rounds_input,
)
from dflash.kernels.triton_gguf_int8 import QuantizedInput, nibble_dequantize
from dflash.kernels.triton_gguf_matmul import gguf_dequantize
from dflash.models.quantized_weights import QuantizedMatrix, is_gpu_supported_type, join_formats

__all__ = ["GGUFEmbedding", "GGUFLinear", "uses_gpu_quantized_weights"]


def _device_blocks(matrix: QuantizedMatrix, device: torch.device) -> torch.Tensor:
    if not is_gpu_supported_type(matrix.qtype):
        raise ModelLoadError(f"the GPU programs do not read {matrix.qtype.name} blocks")
    return matrix.blocks.to(device)  # no copy when the blocks are there already (a tied head shares the table's)


# One word layout per block tensor: a tied LM head and the embedding table share it as they share the blocks.
_WORDS: weakref.WeakKeyDictionary[torch.Tensor, NibbleMatrix] = weakref.WeakKeyDictionary()


def _device_words(matrix: QuantizedMatrix, device: torch.device) -> NibbleMatrix:
    blocks = _device_blocks(matrix, device)
    words = _WORDS.get(blocks)
    if words is None:
        words = nibble_matrix(blocks, matrix.qtype, matrix.columns)
        _WORDS[blocks] = words
    return words


def _register_words(module: nn.Module, suffix: str, words: NibbleMatrix) -> None:
    """The words' tensors as `module`'s buffers (the fp16 scales as their bits: a dtype cast leaves them alone)."""
    module.register_buffer("words" + suffix, words.words, persistent=False)
    module.register_buffer("pairs" + suffix, words.pairs.view(torch.int16), persistent=False)
    module.register_buffer("sub_scales" + suffix, words.sub_scales, persistent=False)
    module.register_buffer("high_bits" + suffix, words.high_bits, persistent=False)


def _words_of(module: nn.Module, suffix: str, qtype: GGMLQuantizationType, k: int) -> NibbleMatrix:
    """The `NibbleMatrix` that `_register_words` stored."""
    words: torch.Tensor = getattr(module, "words" + suffix)
    return NibbleMatrix(qtype, words.shape[0], k, words, getattr(module, "pairs" + suffix).view(torch.float16),
                        getattr(module, "sub_scales" + suffix), getattr(module, "high_bits" + suffix))


class GGUFLinear(nn.Module):
    """y[..., out] = x[..., in] @ dequant(W[out, in])^T (+ bias), W held quantized on the device: one matrix, or
    the rows of several (a fused q/k/v or gate/up) whose formats may differ. Consecutive parts of one format are
    joined into one segment. A segment in Q4_0, Q4_1, Q4_K or Q6_K is kept as words (`dflash.kernels.gguf_nibbles`:
    buffers `words`, `pairs` (the fp16 scales' bits, so a dtype cast of the module leaves them alone) and
    `sub_scales`, `high_bits`, suffixed `_i` past the first segment) for the integer-dot and tensor-core word programs; any
    other format as its GGUF blocks (`blocks`, `blocks_i`) for the block programs. Inputs are rounded once per
    call for every word segment that takes integer products."""

    weight: torch.Tensor

    def __init__(
        self,
        parts: QuantizedMatrix | NibbleMatrix | Sequence[QuantizedMatrix],
        device: torch.device | str,
        dtype: torch.dtype,
        bias: bool = False,
    ) -> None:
        """`parts`: the matrix, or a fused projection's matrices (as loaded), or a matrix already as words."""
        super().__init__()
        device = torch.device(device)
        segments: list[QuantizedMatrix | NibbleMatrix] = (
            [parts] if isinstance(parts, NibbleMatrix)
            else list(join_formats([parts] if isinstance(parts, QuantizedMatrix) else list(parts)))
        )
        self.in_features = segments[0].k if isinstance(segments[0], NibbleMatrix) else segments[0].columns
        self.out_features = sum(s.n if isinstance(s, NibbleMatrix) else s.rows for s in segments)
        self.formats = [GGMLQuantizationType(segment.qtype) for segment in segments]
        self._suffixes = [f"_{i}" if i else "" for i in range(len(segments))]
        for suffix, segment in zip(self._suffixes, segments, strict=True):
            if isinstance(segment, NibbleMatrix):
                _register_words(self, suffix, segment)
            elif segment.qtype in NIBBLE_FORMATS:
                _register_words(self, suffix, _device_words(segment, device))
            else:
                self.register_buffer("blocks" + suffix, _device_blocks(segment, device), persistent=False)
        self.register_buffer("weight", torch.empty(0, dtype=dtype, device=device), persistent=False)
        self.bias = nn.Parameter(torch.zeros(self.out_features, dtype=dtype, device=device)) if bias else None

    @property
    def parts(self) -> list[QuantizedPart]:
        """Each segment in output order: (blocks [rows, row bytes], format), or its `NibbleMatrix`."""
        found: list[QuantizedPart] = []
        for suffix, qtype in zip(self._suffixes, self.formats, strict=True):
            if qtype in NIBBLE_FORMATS:
                found.append(_words_of(self, suffix, qtype, self.in_features))
            else:
                found.append((getattr(self, "blocks" + suffix), qtype))
        return found

    @property
    def qtype(self) -> GGMLQuantizationType:
        """The format of a single-format matrix."""
        if len(self.formats) != 1:
            raise ValueError(f"this matrix has parts in {', '.join(t.name for t in self.formats)}")
        return self.formats[0]

    def forward(self, x: torch.Tensor, rounded: QuantizedInput | None = None) -> torch.Tensor:
        """x [..., in] -> [..., out]; `rounded`: x's rows already rounded where `rounds_input(rows)`."""
        lead = x.shape[:-1]
        y = quantized_linear(x.reshape(-1, self.in_features), self.parts, self.bias, rounded)  # [rows, out]
        return y.view(*lead, self.out_features)

    def rounds_input(self, rows: int) -> bool:
        """Whether a product of `rows` rows reads them rounded to 8-bit parts (`QuantizedInput`), which the program
        producing them can then make (`forward(x, rounded)`)."""
        return rounds_input(self.parts, rows, self.weight.device)

    def dequantized(self) -> torch.Tensor:
        """The weights as a dense [out, in] matrix in the compute dtype."""
        return torch.cat([dequantize_part(part, self.in_features, self.weight.dtype) for part in self.parts])

    def rows(self, ids: torch.Tensor) -> GGUFLinear:
        """A bias-free module over the rows `ids` of a single-format W (an LM head cut to a token shortlist)."""
        part = self.parts[0]
        ids = ids.to(self.weight.device)
        if isinstance(part, NibbleMatrix):
            return GGUFLinear(select_rows(part, ids), ids.device, self.weight.dtype)
        blocks = part[0].index_select(0, ids)
        return GGUFLinear(QuantizedMatrix(blocks, self.qtype, self.in_features), blocks.device, self.weight.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"formats={'+'.join(t.name for t in self.formats)}")


class GGUFEmbedding(nn.Module):
    """ids[...] -> rows[..., dim] of a GGUF table on the device, dequantised on lookup in the compute dtype; a
    Q4_0 / Q4_1 / Q4_K / Q6_K table kept as words (shared with a tied head), any other as its blocks."""

    weight: torch.Tensor
    blocks: torch.Tensor

    def __init__(self, matrix: QuantizedMatrix, device: torch.device | str, dtype: torch.dtype) -> None:
        super().__init__()
        device = torch.device(device)
        self.num_embeddings = matrix.rows
        self.embedding_dim = matrix.columns
        self.qtype = GGMLQuantizationType(matrix.qtype)
        if self.qtype in NIBBLE_FORMATS:
            _register_words(self, "", _device_words(matrix, device))
        else:
            self.register_buffer("blocks", _device_blocks(matrix, device), persistent=False)
        self.register_buffer("weight", torch.empty(0, dtype=dtype, device=device), persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids = input_ids.reshape(-1)
        if self.qtype in NIBBLE_FORMATS:
            table = _words_of(self, "", self.qtype, self.embedding_dim)
            values = nibble_dequantize(select_rows(table, ids), self.weight.dtype)  # [ids, dim]
        else:
            rows = self.blocks.index_select(0, ids)  # [ids, bytes per row]
            values = gguf_dequantize(rows, self.qtype, self.embedding_dim, self.weight.dtype)  # [ids, dim]
        return values.view(*input_ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, qtype={self.qtype.name}"


def uses_gpu_quantized_weights(model: nn.Module) -> bool:
    return any(isinstance(m, (GGUFLinear, GGUFEmbedding)) for m in model.modules())
