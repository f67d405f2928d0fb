"""Frozen model configuration shared by every architecture family.

`ModelConfig.from_hf` reads a Hugging Face `config.json` dictionary; the GGUF loader builds the same record
from GGUF metadata. Model code reads only this record, never the raw dictionaries.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from dflash.errors import ModelLoadError

SUPPORTED_ARCHITECTURES = ("llama", "qwen3", "gemma3", "qwen3_moe")

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a decoder-only transformer, normalised across families."""

    architecture: str  # "llama" | "qwen3" | "gemma3" | "qwen3_moe"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    layer_types: tuple[str, ...]  # one of FULL_ATTENTION / SLIDING_ATTENTION per layer
    sliding_window: int | None = None
    rope_scaling: dict[str, Any] | None = field(default=None, compare=False)
    rope_local_theta: float | None = None  # Gemma 3: RoPE base of the sliding layers
    hidden_act: str = "silu"  # "silu" | "gelu_pytorch_tanh"
    attention_bias: bool = False
    qk_norm: bool = False  # per-head RMSNorm of queries and keys (Qwen3, Gemma 3)
    query_pre_attn_scalar: float | None = None  # attention scale = this ** -0.5 when set
    embed_scale: float = 1.0  # Gemma multiplies embeddings by sqrt(hidden_size)
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Mixture of experts (Qwen3-MoE): 0 experts means every layer has the dense MLP of `intermediate_size`.
    num_experts: int = 0
    num_experts_per_tok: int = 0  # experts each token is routed to (top-k)
    moe_intermediate_size: int = 0  # width of one expert's gated MLP
    norm_topk_prob: bool = False  # rescale the top-k routing weights to sum to 1
    decoder_sparse_step: int = 1  # layer i is sparse when (i + 1) % step == 0 ...
    mlp_only_layers: tuple[int, ...] = ()  # ... and i is not listed here

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"unsupported architecture {self.architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if len(self.layer_types) != self.num_layers:
            raise ModelLoadError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(f"{self.num_heads} attention heads do not divide into {self.num_kv_heads} KV heads")
        if self.num_experts:
            if not 0 < self.num_experts_per_tok <= self.num_experts:
                raise ModelLoadError(
                    f"{self.num_experts_per_tok} experts per token is not within 1..{self.num_experts} experts"
                )
            if self.moe_intermediate_size <= 0 or self.decoder_sparse_step <= 0:
                raise ModelLoadError("a mixture-of-experts model needs a positive expert width and sparse step")

    @property
    def is_moe(self) -> bool:
        """Whether any decoder layer routes tokens to experts instead of one dense MLP."""
        return any(self.sparse_layer(i) for i in range(self.num_layers))

    def sparse_layer(self, index: int) -> bool:
        """Whether decoder layer `index` has the mixture-of-experts block (the rule of transformers' Qwen3-MoE)."""
        return (
            self.num_experts > 0
            and index not in self.mlp_only_layers
            and (index + 1) % self.decoder_sparse_step == 0
        )

    @property
    def attention_scale(self) -> float:
        base = self.query_pre_attn_scalar if self.query_pre_attn_scalar else self.head_dim
        return 1.0 / math.sqrt(base)

    @property
    def norm_adds_one(self) -> bool:
        """Gemma's RMSNorm multiplies by (1 + weight) in the HF convention."""
        return self.architecture == "gemma3"

    @classmethod
    def from_hf(cls, raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
        """Build from a Hugging Face config dictionary (`text_config` of multimodal configs is used)."""
        if "text_config" in raw and isinstance(raw["text_config"], dict):
            raw = {**raw["text_config"], **{k: v for k, v in raw.items() if k in ("eos_token_id", "bos_token_id")}}
        model_type = str(raw.get("model_type", ""))
        arch = _MODEL_TYPES.get(model_type)
        if arch is None:
            raise ModelLoadError(
                f"{source}: unknown model_type {model_type!r}; supported: {', '.join(sorted(_MODEL_TYPES))}"
            )
        try:
            hidden = int(raw["hidden_size"])
            heads = int(raw["num_attention_heads"])
            layers = int(raw["num_hidden_layers"])
            head_dim = int(raw.get("head_dim") or hidden // heads)
            layer_types = _layer_types(raw, arch, layers)
            eos = raw.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else ((int(eos),) if eos is not None else ())
            is_gemma = arch == "gemma3"
            rope_theta, rope_scaling, local_theta = _rope_settings(raw)
            return cls(
                architecture=arch,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_layers=layers,
                num_heads=heads,
                num_kv_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=head_dim,
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=rope_theta,
                max_position_embeddings=int(raw.get("max_position_embeddings", 8192)),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", is_gemma)),
                layer_types=layer_types,
                sliding_window=int(raw["sliding_window"]) if raw.get("sliding_window") else None,
                rope_scaling=rope_scaling,
                rope_local_theta=local_theta if is_gemma else None,
                hidden_act=str(raw.get("hidden_activation") or raw.get("hidden_act") or "silu"),
                attention_bias=bool(raw.get("attention_bias", False)),
                qk_norm=arch in ("qwen3", "gemma3", "qwen3_moe"),
                query_pre_attn_scalar=float(raw["query_pre_attn_scalar"]) if is_gemma else None,
                embed_scale=math.sqrt(hidden) if is_gemma else 1.0,
                final_logit_softcapping=_opt_float(raw.get("final_logit_softcapping")),
                attn_logit_softcapping=_opt_float(raw.get("attn_logit_softcapping")),
                bos_token_id=raw.get("bos_token_id"),
                eos_token_ids=eos_ids,
                **_moe_fields(raw),
            )
        except KeyError as exc:
            raise ModelLoadError(f"{source}: missing required field {exc.args[0]!r}") from None


_MODEL_TYPES = {
    "llama": "llama",
    "qwen3": "qwen3",
    "gemma3": "gemma3",
    "gemma3_text": "gemma3",
    "qwen3_moe": "qwen3_moe",
}


def _moe_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """The mixture-of-experts fields of a config (transformers 5 saves the expert count as `num_local_experts`)."""
    experts = int(raw.get("num_experts") or raw.get("num_local_experts") or 0)
    if not experts:
        return {}
    return {
        "num_experts": experts,
        "num_experts_per_tok": int(raw["num_experts_per_tok"]),
        "moe_intermediate_size": int(raw["moe_intermediate_size"]),
        "norm_topk_prob": bool(raw.get("norm_topk_prob", False)),
        "decoder_sparse_step": int(raw.get("decoder_sparse_step") or 1),
        "mlp_only_layers": tuple(int(i) for i in raw.get("mlp_only_layers") or ()),
    }


def _rope_settings(raw: dict[str, Any]) -> tuple[float, dict[str, Any] | None, float]:
    """(theta, scaling, local theta) from either the flat fields or transformers 5's `rope_parameters`."""
    params = raw.get("rope_parameters") or {}
    full = params.get("full_attention", params) if isinstance(params, dict) else {}
    local = params.get("sliding_attention", {}) if isinstance(params, dict) else {}
    theta = float(raw.get("rope_theta") or full.get("rope_theta") or 10000.0)
    scaling = raw.get("rope_scaling") or None
    if scaling is None and full.get("rope_type", "default") not in ("default", None):
        scaling = dict(full)
    local_theta = float(raw.get("rope_local_base_freq") or local.get("rope_theta") or 10000.0)
    return theta, scaling, local_theta


def _opt_float(value: Any) -> float | None:
    return float(value) if value is not None else None


def _layer_types(raw: dict[str, Any], arch: str, layers: int) -> tuple[str, ...]:
    if raw.get("layer_types"):
        return tuple(str(t) for t in raw["layer_types"])
    if arch == "gemma3":
        pattern = int(raw.get("sliding_window_pattern", 6))
        return tuple(FULL_ATTENTION if (i + 1) % pattern == 0 else SLIDING_ATTENTION for i in range(layers))
    if arch == "qwen3_moe":  # transformers' Qwen3-MoE windows every layer when it windows at all
        sliding = bool(raw.get("use_sliding_window") and raw.get("sliding_window"))
        return (SLIDING_ATTENTION if sliding else FULL_ATTENTION,) * layers
    if raw.get("use_sliding_window") and raw.get("sliding_window"):
        first_full = int(raw.get("max_window_layers", layers))
        return tuple(SLIDING_ATTENTION if i >= first_full else FULL_ATTENTION for i in range(layers))
    return (FULL_ATTENTION,) * layers
