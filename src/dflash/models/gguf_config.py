"""`ModelConfig` from GGUF metadata (llama.cpp's `{arch}.*` keys) and the tensor directory.

Values GGUF does not store are filled in as the Hugging Face configs of the same families have them
(Gemma 3: local RoPE base 10000, GELU-tanh, sqrt(hidden) embedding scale, a full-attention layer
every sixth; Qwen3-MoE: dense layers are those without a router; Qwen3.5, Qwen3.5-MoE and Qwen3-Next:
`dflash.models.gguf_hybrid`; Gemma 4:
`dflash.models.gguf_gemma4`). Llama 3.1-style RoPE scaling is stored by llama.cpp only as a per-frequency factor
tensor (`rope_freqs.weight`); `llama3_rope_scaling` recovers the HF parameters from it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dflash.config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig
from dflash.errors import ModelLoadError
from dflash.models.gguf_gemma4 import gemma4_fields
from dflash.models.gguf_hybrid import GGUF_HYBRID_ARCHITECTURES, hybrid_config_from_gguf

__all__ = ["GGUF_ARCHITECTURES", "config_from_gguf", "llama3_factors", "llama3_rope_scaling"]

# llama.cpp's architecture name -> ours (the Hugging Face model_type family)
GGUF_ARCHITECTURES = {
    "llama": "llama", "qwen3": "qwen3", "gemma3": "gemma3", "qwen3moe": "qwen3_moe", "gemma4": "gemma4",
}

_GEMMA3_SLIDING_PATTERN = 6
_GEMMA3_LOCAL_ROPE_BASE = 10000.0


def config_from_gguf(
    metadata: Mapping[str, Any],
    tensor_shapes: Mapping[str, tuple[int, ...]],
    source: Path,
    rope_freqs: np.ndarray | None = None,
) -> ModelConfig:
    """Build the configuration; `tensor_shapes` are in torch order (rows first)."""
    arch = str(metadata.get("general.architecture", ""))
    if arch in GGUF_HYBRID_ARCHITECTURES:
        return hybrid_config_from_gguf(arch, metadata, tensor_shapes, source)
    if arch not in GGUF_ARCHITECTURES:
        raise ModelLoadError(
            f"{source}: unsupported GGUF architecture {arch!r}; "
            f"supported: {', '.join([*GGUF_ARCHITECTURES, *GGUF_HYBRID_ARCHITECTURES])}"
        )

    def get(key: str, default: Any = None) -> Any:
        return metadata.get(f"{arch}.{key}", default)

    def need(key: str) -> Any:
        value = get(key)
        if value is None:
            raise ModelLoadError(f"{source}: GGUF metadata lacks {arch}.{key}")
        return value

    hidden = int(need("embedding_length"))
    layers = int(need("block_count"))
    heads = _uniform(need("attention.head_count"), f"{arch}.attention.head_count", source)
    is_gemma4 = arch == "gemma4"  # per-layer counts and widths: `gemma4_fields` reads them
    kv_heads = heads if is_gemma4 else _uniform(
        get("attention.head_count_kv", heads), f"{arch}.attention.head_count_kv", source
    )
    head_dim = int(get("attention.key_length") or hidden // heads)
    embed = tensor_shapes.get("token_embd.weight")
    if embed is None or len(embed) != 2:
        raise ModelLoadError(f"{source}: GGUF file has no 2-D token_embd.weight tensor")
    tokens = metadata.get("tokenizer.ggml.tokens")
    vocab = (
        int(embed[0])
        if embed[0]
        else (len(tokens) if isinstance(tokens, list) else int(get("vocab_size", 0)))
    )
    eos = metadata.get("tokenizer.ggml.eos_token_id")
    bos = metadata.get("tokenizer.ggml.bos_token_id")
    is_gemma = arch == "gemma3"
    sliding = get("attention.sliding_window")
    family = gemma4_fields(get, tensor_shapes, layers, hidden, rope_freqs, source) if is_gemma4 else {}
    softcap_final, softcap_attn = get("final_logit_softcapping"), get("attn_logit_softcapping")
    moe = _moe_fields(arch, layers, get, need, tensor_shapes, source)
    dense_width = get("feed_forward_length", moe.get("moe_intermediate_size"))  # MoE files may have no dense MLP
    if dense_width is None:
        dense_width = need("feed_forward_length")
    fields: dict[str, Any] = dict(
        architecture=GGUF_ARCHITECTURES[arch],
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=0 if is_gemma4 else _uniform(dense_width, f"{arch}.feed_forward_length", source),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6 if is_gemma or is_gemma4 else 1e-5)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        max_position_embeddings=int(get("context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensor_shapes,
        layer_types=_layer_types(arch, layers, get("attention.sliding_window_pattern"), source),
        sliding_window=int(sliding) if is_gemma and sliding else None,
        rope_scaling=None if is_gemma4 else _rope_scaling(arch, metadata, rope_freqs, head_dim, source),
        rope_local_theta=float(get("rope.freq_base_swa", _GEMMA3_LOCAL_ROPE_BASE)) if is_gemma else None,
        hidden_act="gelu_pytorch_tanh" if is_gemma else "silu",
        attention_bias="blk.0.attn_q.bias" in tensor_shapes,
        qk_norm="blk.0.attn_q_norm.weight" in tensor_shapes,
        query_pre_attn_scalar=_gemma3_query_scalar(hidden, heads, head_dim, layers) if is_gemma else None,
        embed_scale=math.sqrt(hidden) if is_gemma else 1.0,
        final_logit_softcapping=float(softcap_final) if softcap_final else None,
        attn_logit_softcapping=float(softcap_attn) if softcap_attn else None,
        bos_token_id=int(bos) if bos is not None else None,
        eos_token_ids=(int(eos),) if eos is not None else (),
        **moe,
    )
    fields.update(family)
    return ModelConfig(**fields)


def _moe_fields(
    arch: str,
    layers: int,
    get: Callable[..., Any],
    need: Callable[[str], Any],
    tensor_shapes: Mapping[str, tuple[int, ...]],
    source: Path,
) -> dict[str, Any]:
    """Mixture-of-experts settings of a `qwen3moe` file. llama.cpp records no list of dense layers: a layer is
    sparse exactly when it has a router (`ffn_gate_inp`). It always rescales the top-k routing weights for this
    architecture, unless `expert_weights_norm` says otherwise."""
    if arch != "qwen3moe":
        return {}
    dense = tuple(i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensor_shapes)
    return {
        "num_experts": int(need("expert_count")),
        "num_experts_per_tok": int(need("expert_used_count")),
        "moe_intermediate_size": _uniform(
            need("expert_feed_forward_length"), f"{arch}.expert_feed_forward_length", source
        ),
        "norm_topk_prob": bool(get("expert_weights_norm", True)),
        "decoder_sparse_step": 1,
        "mlp_only_layers": dense,
    }


def _uniform(value: Any, key: str, source: Path) -> int:
    """A per-model integer that llama.cpp may also store per layer (then all layers must agree)."""
    if isinstance(value, list):
        distinct = set(value)
        if len(distinct) != 1:
            raise ModelLoadError(
                f"{source}: {key} differs between layers ({sorted(distinct)}); not supported"
            )
        value = value[0]
    return int(value)


def _layer_types(arch: str, layers: int, pattern: Any, source: Path) -> tuple[str, ...]:
    if arch != "gemma3":
        return (FULL_ATTENTION,) * layers
    if isinstance(pattern, list):  # one flag per layer: true = sliding window
        if len(pattern) != layers:
            raise ModelLoadError(
                f"{source}: sliding_window_pattern has {len(pattern)} entries for {layers} layers"
            )
        return tuple(SLIDING_ATTENTION if flag else FULL_ATTENTION for flag in pattern)
    period = int(pattern) if pattern else _GEMMA3_SLIDING_PATTERN
    return tuple(FULL_ATTENTION if (i + 1) % period == 0 else SLIDING_ATTENTION for i in range(layers))


def _gemma3_query_scalar(hidden: int, heads: int, head_dim: int, layers: int) -> float:
    # Gemma 3 27B scales queries by (hidden / heads) ** -0.5 instead of head_dim ** -0.5; GGUF does not
    # record it, so (like llama.cpp) recognise that model by its shape.
    if layers == 62 and hidden == 5376:
        return float(hidden // heads)
    return float(head_dim)


def _rope_scaling(
    arch: str, metadata: Mapping[str, Any], rope_freqs: np.ndarray | None, head_dim: int, source: Path
) -> dict[str, Any] | None:
    if rope_freqs is not None:
        return llama3_rope_scaling(
            rope_freqs, float(metadata.get(f"{arch}.rope.freq_base", 10000.0)), head_dim, source
        )
    kind = metadata.get(f"{arch}.rope.scaling.type")
    factor = metadata.get(f"{arch}.rope.scaling.factor")
    if kind in (None, "none") or not factor or float(factor) == 1.0:
        return None
    scaling: dict[str, Any] = {"rope_type": str(kind), "factor": float(factor)}
    original = metadata.get(f"{arch}.rope.scaling.original_context_length")
    if original:
        scaling["original_max_position_embeddings"] = int(original)
    for gguf_key, hf_key in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
        value = metadata.get(f"{arch}.rope.scaling.{gguf_key}")
        if value is not None:
            scaling[hf_key] = float(value)
    return scaling


def llama3_rope_scaling(
    factors: np.ndarray,
    base: float,
    head_dim: int,
    source: Path | str,
    candidates: Sequence[tuple[float, float, int]] = ((1.0, 4.0, 8192),),
) -> dict[str, Any]:
    """HF `rope_scaling` of type "llama3" whose per-frequency factors equal `factors`.

    `candidates` are (low_freq_factor, high_freq_factor, original_max_position_embeddings) to try;
    the scaling factor itself is the largest entry of `factors`.
    """
    factors = np.asarray(factors, dtype=np.float64).reshape(-1)
    if factors.shape[0] != head_dim // 2:
        raise ModelLoadError(f"{source}: rope_freqs has {factors.shape[0]} entries for head_dim {head_dim}")
    factor = float(factors.max())
    for low, high, original in candidates:
        if np.allclose(
            llama3_factors(base, head_dim, factor, low, high, original), factors, rtol=1e-4, atol=1e-6
        ):
            return {
                "rope_type": "llama3",
                "factor": factor,
                "low_freq_factor": low,
                "high_freq_factor": high,
                "original_max_position_embeddings": original,
            }
    raise ModelLoadError(
        f"{source}: rope_freqs.weight holds RoPE frequency factors that match no known scaling scheme; "
        "only Llama 3.1-style scaling is supported"
    )


def llama3_factors(
    base: float, head_dim: int, factor: float, low: float, high: float, original: int
) -> np.ndarray:
    """Per-frequency divisors of Llama 3.1 RoPE scaling (what llama.cpp stores as rope_freqs)."""
    freqs = 1.0 / base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / freqs
    smooth = (original / wavelen - low) / (high - low)
    middle = 1.0 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < original / high, 1.0, np.where(wavelen > original / low, factor, middle))
