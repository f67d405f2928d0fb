"""Gemma 4 in GGUF (llama.cpp architecture `gemma4`): its configuration from the metadata, and its tensor names.

llama.cpp's converter writes the head width of the full-attention layers as `attention.key_length` and that of the
sliding ones as `attention.key_length_swa`; per-layer K/V head counts and MLP widths as arrays when they differ
(wide global layers, double-wide MLPs of the K/V-sharing layers); which layers slide as a flag per layer. Partial
("proportional") RoPE of the full-attention layers is a `rope_freqs` tensor of frequency divisors: 1 for the
rotated pairs, a huge number for the others. Values from the key projection show as full-attention layers
without `attn_v`. Norm weights are stored as transformers has them (Gemma 4 multiplies by the weight itself).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from dflash.config import FULL_ATTENTION, SLIDING_ATTENTION
from dflash.errors import ModelLoadError

__all__ = ["GEMMA4_GLOBAL_NAMES", "GEMMA4_LAYER_NAMES", "gemma4_fields", "gemma4_tensor_name"]

GEMMA4_GLOBAL_NAMES = {
    "per_layer_token_embd": "model.embed_tokens_per_layer",
    "per_layer_model_proj": "model.per_layer_model_projection",
    "per_layer_proj_norm": "model.per_layer_projection_norm",
}
GEMMA4_LAYER_NAMES = {
    "inp_gate": "per_layer_input_gate",
    "proj": "per_layer_projection",
    "post_norm": "post_per_layer_input_norm",
}


def gemma4_tensor_name(gguf_name: str) -> str | None:
    """The transformers name of a Gemma 4-only tensor (per-layer inputs, the layer scalar), else None."""
    stem, _, kind = gguf_name.rpartition(".")
    if stem in GEMMA4_GLOBAL_NAMES and kind == "weight":
        return f"{GEMMA4_GLOBAL_NAMES[stem]}.weight"
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[3] == "weight":
        if parts[2] == "layer_output_scale":  # a buffer in transformers, without the `.weight` suffix
            return f"model.layers.{parts[1]}.layer_scalar"
        if parts[2] in GEMMA4_LAYER_NAMES:
            return f"model.layers.{parts[1]}.{GEMMA4_LAYER_NAMES[parts[2]]}.weight"
    return None


def gemma4_fields(
    get: Callable[..., Any],
    tensor_shapes: Mapping[str, tuple[int, ...]],
    layers: int,
    hidden: int,
    rope_freqs: np.ndarray | None,
    source: Path,
) -> dict[str, Any]:
    """The `ModelConfig` fields of a `gemma4` GGUF that differ from the generic reading (heads, widths, layer
    kinds, RoPE, per-layer inputs and K/V sharing)."""
    if get("expert_count"):
        raise ModelLoadError(f"{source}: Gemma 4 mixture-of-experts models are not supported")
    pattern = get("attention.sliding_window_pattern")
    if not isinstance(pattern, list) or len(pattern) != layers:
        raise ModelLoadError(f"{source}: gemma4.attention.sliding_window_pattern must hold one flag per layer")
    layer_types = tuple(SLIDING_ATTENTION if flag else FULL_ATTENTION for flag in pattern)
    full = [i for i, kind in enumerate(layer_types) if kind == FULL_ATTENTION]
    global_head_dim = int(get("attention.key_length"))
    head_dim = int(get("attention.key_length_swa") or global_head_dim)
    kv_heads = _per_type(get("attention.head_count_kv"), layer_types, "attention.head_count_kv", source)
    widths = get("feed_forward_length")
    widths = [int(w) for w in widths] if isinstance(widths, list) else [int(widths)] * layers
    shared = int(get("attention.shared_kv_layers") or 0)
    first_shared = layers - shared
    base_width = widths[0]
    doubled = shared > 0 and widths[first_shared] == 2 * base_width
    expected = [base_width * (2 if doubled and i >= first_shared else 1) for i in range(layers)]
    if widths != expected:
        raise ModelLoadError(f"{source}: gemma4.feed_forward_length per layer {widths} is not a supported pattern")
    own_full = [i for i in full if i < first_shared]
    k_eq_v = bool(own_full) and all(f"blk.{i}.attn_v.weight" not in tensor_shapes for i in own_full)
    per_layer = int(get("embedding_length_per_layer_input") or 0)
    per_layer_table = tensor_shapes.get("per_layer_token_embd.weight")
    sliding = get("attention.sliding_window")
    return {
        "head_dim": head_dim,
        "num_kv_heads": kv_heads[SLIDING_ATTENTION] if SLIDING_ATTENTION in kv_heads else kv_heads[FULL_ATTENTION],
        "intermediate_size": base_width,
        "layer_types": layer_types,
        "sliding_window": int(sliding) if sliding else None,
        "rope_scaling": _proportional_rope(rope_freqs, global_head_dim, source),
        "rope_local_theta": float(get("rope.freq_base_swa", 10000.0)),
        "hidden_act": "gelu_pytorch_tanh",
        "embed_scale": math.sqrt(hidden),
        "global_head_dim": global_head_dim,
        "global_num_kv_heads": kv_heads.get(FULL_ATTENTION),
        "attention_k_eq_v": k_eq_v,
        "num_kv_shared_layers": shared,
        "double_wide_mlp": doubled,
        "hidden_size_per_layer_input": per_layer,
        "vocab_size_per_layer_input": int(per_layer_table[0]) if per_layer and per_layer_table else 0,
        "fixed_attention_scale": 1.0,
    }


def _per_type(value: Any, layer_types: tuple[str, ...], key: str, source: Path) -> dict[str, int]:
    """A per-layer (or single) count as one value per layer type; layers of one type must agree."""
    values = [int(v) for v in value] if isinstance(value, list) else [int(value)] * len(layer_types)
    if len(values) != len(layer_types):
        raise ModelLoadError(f"{source}: gemma4.{key} has {len(values)} entries for {len(layer_types)} layers")
    by_type: dict[str, int] = {}
    for kind, count in zip(layer_types, values, strict=True):
        if by_type.setdefault(kind, count) != count:
            raise ModelLoadError(f"{source}: gemma4.{key} differs between {kind} layers; not supported")
    return by_type


def _proportional_rope(rope_freqs: np.ndarray | None, head_dim: int, source: Path) -> dict[str, Any] | None:
    """transformers' "proportional" RoPE parameters from llama.cpp's divisors (1: rotated, huge: not rotated)."""
    if rope_freqs is None:
        return None
    divisors = np.asarray(rope_freqs, dtype=np.float64).reshape(-1)
    rotated = int(np.count_nonzero(divisors == 1.0))
    if divisors.shape[0] != head_dim // 2 or not np.all(divisors[rotated:] > 1e20) or rotated == 0:
        raise ModelLoadError(f"{source}: rope_freqs.weight is not the partial-rotation pattern Gemma 4 uses")
    return {"rope_type": "proportional", "partial_rotary_factor": 2 * rotated / head_dim}
