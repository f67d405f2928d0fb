"""Loading a GGUF file with its matrices left quantized (a `QuantizedCheckpoint`), for the CPU kernel or the
GPU programs.

Every 2-D tensor (projections, embedding, LM head) must be in a format the device's code reads (Q4_0, Q4_1, Q8_0,
Q4_K, Q5_K, Q6_K: on the CPU the int8 kernel reads them all, the float32 and bf16 kernels Q4_1 and Q8_0) or one
rewritten into such a format without loss (`gguf_transcode`: Q5_0 as Q8_0); its blocks are copied out of the file
as they are, with llama's Q/K rows put back in Hugging Face order (a row permutation). 1-D tensors (norms, biases)
are dequantised and converted exactly as the dense loader does.

Qwen3.5 hybrids (`qwen35`) load too: their value-head rows are put back in transformers' order on the blocks, the
output projection keeps its columns and an input order (`gguf_hybrid.hybrid_block_rows`); the convolution kernel
stays dense, and so do the b and a projections where the file stores them in float. Mixtures of experts are
declined (no expert product over blocks yet).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType

from dflash.errors import ModelLoadError
from dflash.models.checkpoint import validate_weights
from dflash.models.gguf_file import GGUFFile
from dflash.models.gguf_hybrid import GGUF_HYBRID_ARCHITECTURES, hybrid_block_rows
from dflash.models.gguf_loader import open_gguf_model, undo_conversion
from dflash.models.gguf_transcode import effective_format, transcode_blocks
from dflash.models.quantized_weights import (
    QuantizedCheckpoint,
    QuantizedMatrix,
    is_gpu_supported_type,
    is_supported_type,
)

__all__ = [
    "describe_unsupported",
    "is_hybrid_file",
    "load_gguf_quantized",
    "mixture_of_experts_obstacle",
    "reads_format",
    "stays_dense",
    "tensor_type_counts",
    "unsupported_matrices",
]

# Tensors that hold configuration rather than parameters (never quantized matrices).
_NON_PARAMETERS = {"rope_freqs.weight"}
_FLOAT_TYPES = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)


def stays_dense(gguf_name: str, qtype: GGMLQuantizationType, hybrid: bool) -> bool:
    """Whether a 2-D tensor is loaded dense by the quantized loader: a hybrid's convolution kernel (not a
    matrix), and its one-row-per-head b and a projections where the file keeps them in float."""
    if not hybrid:
        return False
    small = ".ssm_beta." in gguf_name or ".ssm_alpha." in gguf_name
    return ".ssm_conv1d." in gguf_name or (small and qtype in _FLOAT_TYPES)


def reads_format(device_type: str, qtype: GGMLQuantizationType) -> bool:
    """Whether the quantized code of `device_type` ("cpu": the CPU kernels, "cuda": the GPU programs) reads `qtype`
    once loaded (a format of `TRANSCODED` as the one it is rewritten into)."""
    kept = effective_format(qtype)
    return is_gpu_supported_type(kept) if device_type == "cuda" else is_supported_type(kept)


def unsupported_matrices(gguf: GGUFFile, device_type: str = "cpu") -> dict[str, str]:
    """GGUF name -> type name of every matrix the quantized path of `device_type` cannot use."""
    hybrid = is_hybrid_file(gguf)
    return {
        name: info.qtype.name
        for name, info in gguf.tensors.items()
        if len(info.shape) == 2 and name not in _NON_PARAMETERS and not reads_format(device_type, info.qtype)
        and not stays_dense(name, info.qtype, hybrid)
    }


def is_hybrid_file(gguf: GGUFFile) -> bool:
    return str(gguf.metadata.get("general.architecture", "")) in GGUF_HYBRID_ARCHITECTURES


def mixture_of_experts_obstacle(gguf: GGUFFile) -> str | None:
    """Why the quantized path declines this file's experts, or None when it has none."""
    experts = [name for name, info in gguf.tensors.items() if len(info.shape) == 3]
    if not experts:
        return None
    return (
        f"the model is a mixture of experts ({len(experts)} stacked expert tensors such as {experts[0]}); "
        "the quantized kernels have no expert product, so they run as dense weights"
    )


def tensor_type_counts(gguf: GGUFFile) -> dict[str, int]:
    """Type name -> how many tensors of the file use it."""
    counts: dict[str, int] = {}
    for info in gguf.tensors.values():
        counts[info.qtype.name] = counts.get(info.qtype.name, 0) + 1
    return counts


def describe_unsupported(unsupported: dict[str, str], device_type: str = "cpu") -> str:
    types = sorted(set(unsupported.values()))
    example = next(iter(unsupported))
    reader = "the quantized GPU programs" if device_type == "cuda" else "the quantized CPU kernels"
    reader += " read Q4_0, Q4_1, Q8_0, Q4_K, Q5_K and Q6_K (Q5_0 rewritten as Q8_0)"
    return f"{len(unsupported)} matrices are in {', '.join(types)} (e.g. {example}); {reader}"


def load_gguf_quantized(path: Path, device_type: str = "cpu") -> QuantizedCheckpoint:
    """Load a GGUF with its matrices kept as raw blocks for the quantized code of `device_type` ("cpu" or "cuda");
    raises `ModelLoadError` if one is in a format that code does not read."""
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"{path}: no such GGUF file")
    gguf, config, names, tokenizer = open_gguf_model(path)
    moe = mixture_of_experts_obstacle(gguf)
    if moe is not None:
        raise ModelLoadError(f"{path}: cannot keep the weights quantized: {moe} (use --weights dense)")
    unsupported = unsupported_matrices(gguf, device_type)
    if unsupported:
        reason = describe_unsupported(unsupported, device_type)
        raise ModelLoadError(f"{path}: cannot keep the weights quantized: {reason}")
    matrices: dict[str, QuantizedMatrix] = {}
    dense: dict[str, torch.Tensor] = {}
    input_orders: dict[str, torch.Tensor] = {}
    for gguf_name, hf_name in names.items():
        info = gguf.tensors[gguf_name]
        if len(info.shape) == 2 and not stays_dense(gguf_name, info.qtype, config.is_hybrid):
            blocks = torch.from_numpy(np.array(gguf.raw(info), dtype=np.uint8, order="C"))  # a copy, writable
            blocks = transcode_blocks(blocks, info.qtype)  # [rows, bytes] in effective_format(info.qtype)
            if config.is_hybrid:
                blocks, order = hybrid_block_rows(blocks, gguf_name, config)
                if order is not None:
                    input_orders[hf_name] = order
            else:
                blocks = undo_conversion(blocks, gguf_name, config)
            matrices[hf_name] = QuantizedMatrix(blocks.contiguous(), effective_format(info.qtype), info.shape[1])
        else:
            values = np.array(gguf.dequantize(info), dtype=np.float32, order="C")
            dense[hf_name] = undo_conversion(torch.from_numpy(values), gguf_name, config)
        gguf.release(info)  # copied: the file's pages need not stay resident
    shapes = {name: torch.empty(m.shape, device="meta") for name, m in matrices.items()}
    validate_weights(config, {**dense, **shapes}, path)
    return QuantizedCheckpoint(config, dense, tokenizer, path, matrices, input_orders)
