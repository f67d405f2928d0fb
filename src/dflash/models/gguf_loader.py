"""Loading a GGUF file (llama, qwen3, gemma3, qwen3moe, qwen35, qwen35moe, qwen3next, gemma4) into a `Checkpoint` in
the Hugging Face convention.

Steps: parse the header (`GGUFFile`), build the config (`config_from_gguf`) and tokenizer, map
llama.cpp tensor names to transformers names, check every shape before doing any work, dequantise
with `gguf.quants.dequantize`, then undo what llama.cpp's converter did to the weights:

* llama: rows of Q and K were interleaved per head for llama.cpp's RoPE layout (pairs (2i, 2i+1)
  instead of HF's halves (i, i + d/2)); they are put back.
* gemma3: 1 was added to every RMSNorm weight (llama.cpp multiplies by `weight`, HF by `1 + weight`);
  it is subtracted again.
* qwen3moe: nothing to undo; the 3-D expert tensors are dequantised whole, to dense stacked experts.
* qwen35, qwen35moe, qwen3next: names and conversions of their own (`gguf_hybrid`); tensors the converter split
  are joined again afterwards (`gguf_hybrid_moe.join_projections`).
* gemma4: nothing to undo (its norms multiply by the weight itself); names in `dflash.models.gguf_gemma4`.

The result is cached as fp32 safetensors (see `gguf_cache`) when dequantising took long enough.
"""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from dflash.config import ModelConfig
from dflash.errors import ModelLoadError
from dflash.models import gguf_cache
from dflash.models.checkpoint import Checkpoint, validate_weights
from dflash.models.gguf_config import config_from_gguf
from dflash.models.gguf_file import GGUFFile, GGUFTensorInfo
from dflash.models.gguf_gemma4 import gemma4_tensor_name
from dflash.models.gguf_hybrid import hybrid_hf_shape, hybrid_tensor_name, undo_hybrid_conversion
from dflash.models.gguf_hybrid_moe import join_projections
from dflash.tokenizer import Tokenizer

__all__ = ["ProgressCallback", "hf_tensor_name", "load_gguf", "open_gguf_model", "undo_conversion"]

ProgressCallback = Callable[[int, int], None]  # (tensors done, tensors in all)

# Dequantisation shorter than this is not worth a cache entry (tiny test files, for instance).
CACHE_MIN_SECONDS = 0.3
_PROGRESS_MIN_ELEMENTS = 50_000_000

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GEMMA3_LAYER_NAMES = {
    **_LAYER_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_QWEN3_MOE_LAYER_NAMES = {**_LAYER_NAMES, "ffn_gate_inp": "mlp.gate"}
# Stacked experts [experts, out, in] keep transformers' suffix-less names (`dflash.models.moe_weights`).
_EXPERT_NAMES = {
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Tensors that hold configuration rather than parameters.
_NON_PARAMETERS = {"rope_freqs.weight"}


def hf_tensor_name(architecture: str, gguf_name: str) -> str | None:
    """The transformers name of a llama.cpp tensor name, or None if the model has no such tensor."""
    if architecture == "gemma4" and (name := gemma4_tensor_name(gguf_name)) is not None:
        return name
    stem, _, kind = gguf_name.rpartition(".")
    if stem in _GLOBAL_NAMES and kind in ("weight", "bias"):
        return f"{_GLOBAL_NAMES[stem]}.{kind}"
    match = _LAYER_RE.fullmatch(gguf_name)
    if match is None:
        return None
    if architecture == "qwen3_moe" and match.group(2) in _EXPERT_NAMES and match.group(3) == "weight":
        return f"model.layers.{match.group(1)}.{_EXPERT_NAMES[match.group(2)]}"
    table = {"gemma3": _GEMMA3_LAYER_NAMES, "gemma4": _GEMMA3_LAYER_NAMES, "qwen3_moe": _QWEN3_MOE_LAYER_NAMES}.get(
        architecture, _LAYER_NAMES
    )
    part = table.get(match.group(2))
    return f"model.layers.{match.group(1)}.{part}.{match.group(3)}" if part else None


def _global_tensor_name(gguf_name: str) -> str | None:
    """The transformers name of a tensor outside the decoder blocks (embedding, final norm, LM head), else None."""
    return hf_tensor_name("", gguf_name) if not gguf_name.startswith("blk.") else None


def load_gguf(
    path: Path,
    dtype: torch.dtype = torch.float32,
    *,
    progress: ProgressCallback | None = None,
    use_cache: bool = True,
) -> Checkpoint:
    """Load a GGUF file; weights come back in `dtype`, under Hugging Face names."""
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"{path}: no such GGUF file")
    if use_cache:
        cached = gguf_cache.load_cached(path)
        if cached is not None:
            validate_weights(cached.config, cached.weights, path)
            return Checkpoint(cached.config, _to_dtype(cached.weights, dtype), cached.tokenizer, path)

    gguf, config, names, tokenizer = open_gguf_model(path)
    started = time.perf_counter()
    weights = _dequantize_all(gguf, names, config, progress)
    elapsed = time.perf_counter() - started
    validate_weights(config, weights, path)
    if use_cache and elapsed >= CACHE_MIN_SECONDS:
        gguf_cache.store(path, config, weights, tokenizer)
    return Checkpoint(config, _to_dtype(weights, dtype), tokenizer, path)


def open_gguf_model(path: Path) -> tuple[GGUFFile, ModelConfig, dict[str, str], Tokenizer | None]:
    """Parse a GGUF's header: the file, the config, GGUF -> Hugging Face tensor names, and the tokenizer.

    Tensor shapes are checked against the config here, before any tensor data is read.
    """
    gguf = GGUFFile(path)
    shapes = {name: info.shape for name, info in gguf.tensors.items()}
    rope_info = gguf.tensors.get("rope_freqs.weight")
    rope_freqs = gguf.dequantize(rope_info) if rope_info is not None else None
    config = config_from_gguf(gguf.metadata, shapes, path, rope_freqs)
    names = _name_map(config, gguf.tensors, path)
    shape_of = hybrid_hf_shape if config.is_hybrid else (lambda name, shape: shape)
    meta = {hf: torch.empty(shape_of(g, gguf.tensors[g].shape), device="meta") for g, hf in names.items()}
    validate_weights(config, join_projections(config, meta, path) if config.is_hybrid else meta, path)
    tokenizer = None
    if isinstance(gguf.metadata.get("tokenizer.ggml.tokens"), list):
        tokenizer = Tokenizer.from_gguf_metadata(gguf.metadata, source=str(path))
        eos = (*config.eos_token_ids, *tokenizer.eos_token_ids)
        config = replace(config, eos_token_ids=tuple(dict.fromkeys(eos)))
        tokenizer = tokenizer.with_eos_token_ids(config.eos_token_ids)
    return gguf, config, names, tokenizer


def _name_map(config: ModelConfig, tensors: dict[str, GGUFTensorInfo], path: Path) -> dict[str, str]:
    arch = config.architecture
    names: dict[str, str] = {}
    unknown: list[str] = []
    for gguf_name in tensors:
        if gguf_name in _NON_PARAMETERS:
            continue
        if config.is_hybrid:
            hf = _global_tensor_name(gguf_name) or hybrid_tensor_name(gguf_name, config.num_layers)
        else:
            hf = hf_tensor_name(arch, gguf_name)
        if hf is None:
            unknown.append(gguf_name)
        elif hf:  # "" = a tensor the model does not use (multi-token-prediction blocks)
            names[gguf_name] = hf
    if unknown:
        shown = ", ".join(unknown[:5]) + (f" (and {len(unknown) - 5} more)" if len(unknown) > 5 else "")
        raise ModelLoadError(f"{path}: tensors a {arch} model does not have: {shown}")
    return names


def _dequantize_all(
    gguf: GGUFFile, names: dict[str, str], config: ModelConfig, progress: ProgressCallback | None
) -> dict[str, torch.Tensor]:
    weights: dict[str, torch.Tensor] = {}
    total_elements = sum(gguf.tensors[g].n_elements for g in names)
    with _progress(progress, len(names), total_elements, gguf.path.name) as step:
        for done, (gguf_name, hf_name) in enumerate(names.items(), start=1):
            info = gguf.tensors[gguf_name]
            values = gguf.dequantize(info)
            if not values.flags.writeable or not values.flags.c_contiguous:
                values = np.array(values, dtype=np.float32, order="C")
            weights[hf_name] = undo_conversion(torch.from_numpy(values), gguf_name, config)
            step(done)
    return join_projections(config, weights, gguf.path) if config.is_hybrid else weights


def undo_conversion(tensor: torch.Tensor, gguf_name: str, config: ModelConfig) -> torch.Tensor:
    """Undo llama.cpp's conversion-time changes to one tensor. The Q/K change is a permutation of rows, so it
    applies unchanged to a matrix kept as raw quantised blocks ([rows, bytes per row]); the hybrids' changes do
    not (their quantized loading is refused)."""
    if config.is_hybrid:
        return undo_hybrid_conversion(tensor, gguf_name, config)
    if config.architecture == "llama":
        if ".attn_q." in gguf_name:
            return _unpermute_rope_rows(tensor, config.num_heads)
        if ".attn_k." in gguf_name:
            return _unpermute_rope_rows(tensor, config.num_kv_heads)
    if config.norm_adds_one and gguf_name.endswith("norm.weight"):
        return tensor - 1.0
    return tensor


def _unpermute_rope_rows(tensor: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows per head go from llama.cpp's interleaved order (0, d/2, 1, d/2+1, ...) back to HF's."""
    rows = tensor.shape[0]
    half = rows // heads // 2
    rest = tensor.shape[1:]
    return tensor.reshape(heads, half, 2, *rest).transpose(1, 2).reshape(rows, *rest).contiguous()


def _to_dtype(weights: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    if all(t.dtype == dtype for t in weights.values()):
        return weights
    return {name: t.to(dtype) for name, t in weights.items()}


@contextmanager
def _progress(
    callback: ProgressCallback | None, total: int, elements: int, label: str
) -> Iterator[Callable[[int], None]]:
    """Report per-tensor progress to `callback`, or on a rich progress bar for big files on a terminal."""
    if callback is not None:
        yield lambda done: callback(done, total)
        return
    if elements < _PROGRESS_MIN_ELEMENTS or not sys.stderr.isatty():
        yield lambda done: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn(f"dequantising {label}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("dequantise", total=total)
        yield lambda done: bar.update(task, completed=done)
