"""Choosing between dense weights and quantized GGUF blocks (`--weights auto|dense|quantized`).

`auto` picks quantized when all of these hold, dense otherwise:
  * the device is the CPU and the dtype float32 (GPUs, and other dtypes, stay dense);
  * the model is a GGUF file whose every matrix is in a format a CPU kernel reads (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K,
    Q6_K), and not a mixture of experts (its 3-D expert tensors are dequantised to dense weights: the kernel has
    no grouped expert product yet);
  * the CPU kernel builds (or was built before) and loads; for matrices in Q4_0 or the K formats the int8 kernel
    too, which needs AVX2 (`dflash.models.cpu_matmul`).
A kernel that fails to build is logged as a warning naming the reason; the other cases are expected and
logged at info level. `quantized` requested explicitly raises `ModelLoadError` with the reason instead.

`quantized` on a CUDA device keeps the matrices quantized on the GPU for the Triton programs
(`dflash.models.gpu_quantized_layers`): the dtype must be bfloat16 or float16, Triton installed, and every matrix
in a format they read (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K); the model kinds the CPU path declines (Gemma 4,
mixtures of experts) are declined there too. Qwen3.5 hybrids with dense MLPs keep their matrices quantized on
either device (their convolution kernels stay dense). `auto` on a GPU stays dense: on a Qwen3-8B-shaped Q4_K_M
file quantized weights decode 1.28x faster than bf16 but process prompts at 0.68x (results/gpu_peers_h100.json),
so they are for decode-bound use and for models whose dense weights would not fit.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import get_args

import torch

from dflash.errors import DFlashError, ModelLoadError
from dflash.models.resolve import WeightKind

__all__ = ["WEIGHT_OPTIONS", "WeightChoice", "choose_weights"]

log = logging.getLogger(__name__)

WEIGHT_OPTIONS = ("auto", *get_args(WeightKind))


@dataclass(frozen=True)
class WeightChoice:
    kind: WeightKind
    reason: str


def choose_weights(requested: str, path: Path, device: torch.device, dtype: torch.dtype) -> WeightChoice:
    """Which weights to load for the model at `path` on `device` in `dtype` (see the module docstring)."""
    if requested not in WEIGHT_OPTIONS:
        raise DFlashError(f"unknown weights option {requested!r}; choose one of {', '.join(WEIGHT_OPTIONS)}")
    if requested == "dense":
        return WeightChoice("dense", "dense weights requested")
    if device.type == "cuda":
        return _gpu_choice(requested, path, dtype)
    obstacle = _setting_obstacle(path, device, dtype)
    kernel_failed = False
    if obstacle is None:
        from dflash.kernels.build import KernelUnavailable, load_quant_kernel

        try:
            load_quant_kernel()
        except KernelUnavailable as exc:
            obstacle, kernel_failed = str(exc), True
    if obstacle is None:
        obstacle = _int8_kernel_obstacle(path)
        kernel_failed = obstacle is not None
    if requested == "quantized":
        if obstacle is not None:
            raise ModelLoadError(f"{path.name}: quantized weights are not available: {obstacle}")
        return WeightChoice("quantized", "quantized weights requested")
    if obstacle is None:
        return WeightChoice("quantized", "auto: CPU, float32, every matrix in a format the kernel reads")
    if kernel_failed:
        log.warning("using dense float32 weights instead of quantized ones: %s", obstacle)
    else:
        log.info("using dense weights: %s", obstacle)
    return WeightChoice("dense", f"auto: {obstacle}")


def _int8_kernel_obstacle(path: Path) -> str | None:
    """Why the matrices of the GGUF at `path` that only the int8 kernel reads cannot run here, or None."""
    from dflash.models.cpu_matmul import int8_obstacle, int8_only_formats
    from dflash.models.gguf_file import GGUFFile

    gguf = GGUFFile(path)
    needing = int8_only_formats(info.qtype for info in gguf.tensors.values() if len(info.shape) == 2)
    if not needing:
        return None
    why = int8_obstacle()
    return None if why is None else f"its {', '.join(needing)} matrices need the int8 kernel: {why}"


def _gpu_choice(requested: str, path: Path, dtype: torch.dtype) -> WeightChoice:
    """`auto` -> dense (quantized GPU weights are opt-in); `quantized` -> the blocks on the GPU, or the reason not."""
    if requested == "auto":
        log.info("using dense weights on the GPU (quantized GPU weights are opt-in: --weights quantized)")
        return WeightChoice("dense", "auto: dense weights on a GPU (quantized GPU weights are opt-in: --weights quantized)")
    from dflash.kernels.triton_decode import triton_available

    if dtype not in (torch.bfloat16, torch.float16):
        obstacle: str | None = (
            f"the GPU block programs take bfloat16 or float16 (dtype is {str(dtype).removeprefix('torch.')})"
        )
    elif not triton_available():
        obstacle = "the GPU block programs need Triton, which is not installed"
    else:
        obstacle = _model_obstacle(path, "cuda")
    if obstacle is not None:
        raise ModelLoadError(f"{path.name}: quantized weights are not available: {obstacle}")
    return WeightChoice("quantized", "quantized weights requested (GGUF blocks on the GPU)")


def _setting_obstacle(path: Path, device: torch.device, dtype: torch.dtype) -> str | None:
    """Why quantized weights cannot be used for this model, device and dtype (kernel aside), or None."""
    if device.type != "cpu":
        return f"the quantized kernel runs on the CPU only (device is {device})"
    if dtype != torch.float32:
        return f"the quantized kernel computes in float32 (dtype is {str(dtype).removeprefix('torch.')})"
    return _model_obstacle(path, "cpu")


def _model_obstacle(path: Path, device_type: str) -> str | None:
    """Why the model at `path` cannot keep quantized weights for `device_type`'s code, or None."""
    if path.is_dir() or path.suffix.lower() != ".gguf":
        return "the model is not a GGUF file"
    from dflash.models.gguf_file import GGUFFile
    from dflash.models.gguf_quantized import (
        describe_unsupported,
        mixture_of_experts_obstacle,
        unsupported_matrices,
    )

    gguf = GGUFFile(path)
    if gguf.metadata.get("general.architecture") == "gemma4":
        return "quantized CPU weights do not support Gemma 4 yet"
    moe = mixture_of_experts_obstacle(gguf)
    if moe is not None:
        return moe
    unsupported = unsupported_matrices(gguf, device_type)
    return describe_unsupported(unsupported, device_type) if unsupported else None
