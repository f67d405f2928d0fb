"""Frozen model configuration shared by every architecture family.

`ModelConfig.from_hf` reads a Hugging Face `config.json` dictionary; the GGUF loader builds the same record
from GGUF metadata. Model code reads only this record, never the raw dictionaries.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from dflash.errors import ModelLoadError

SUPPORTED_ARCHITECTURES = ("llama", "qwen3", "gemma3", "qwen3_moe", "qwen3_5", "qwen3_next")
# Families whose layers keep a recurrent state besides (or instead of) K/V: see `dflash.kv.recurrent`.
HYBRID_ARCHITECTURES = ("qwen3_5", "qwen3_next")
# Families with a mixture of experts in (some of) their layers: `ModelConfig.sparse_layer` says which.
MOE_ARCHITECTURES = ("qwen3_moe", "qwen3_next")

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
LINEAR_ATTENTION = "linear_attention"  # Gated DeltaNet (Qwen3.5): a convolution window and a recurrent state

_MODEL_TYPES = {
    "llama": "llama",
    "qwen3": "qwen3",
    "gemma3": "gemma3",
    "gemma3_text": "gemma3",
    "qwen3_moe": "qwen3_moe",
    "qwen3_5": "qwen3_5",
    "qwen3_5_text": "qwen3_5",
    "qwen3_next": "qwen3_next",
}


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a decoder-only transformer, normalised across families."""

    architecture: str  # "llama" | "qwen3" | "gemma3" | "qwen3_moe" | "qwen3_5" | "qwen3_next"
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
    layer_types: tuple[str, ...]  # one of FULL_ATTENTION / SLIDING_ATTENTION / LINEAR_ATTENTION per layer
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
    # Mixture of experts (Qwen3-MoE, Qwen3-Next): 0 experts means every layer has the dense MLP of
    # `intermediate_size`.
    num_experts: int = 0
    num_experts_per_tok: int = 0  # experts each token is routed to (top-k)
    moe_intermediate_size: int = 0  # width of one expert's gated MLP
    norm_topk_prob: bool = False  # rescale the top-k routing weights to sum to 1
    decoder_sparse_step: int = 1  # layer i is sparse when (i + 1) % step == 0 ...
    mlp_only_layers: tuple[int, ...] = ()  # ... and i is not listed here
    # Qwen3-Next adds to every sparse layer a shared gated MLP of this width, scaled by a sigmoid gate (0: none)
    shared_expert_intermediate_size: int = 0
    # Qwen3.5 hybrid: full-attention layers rotate only the first head_dim * partial_rotary_factor channels of a
    # head and gate their output by sigmoid(a second query projection); linear-attention layers are Gated DeltaNet
    partial_rotary_factor: float = 1.0
    attention_output_gate: bool = False
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel: int = 0  # width of the causal depthwise convolution over the q/k/v projections

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
        unknown = sorted(set(self.layer_types) - {FULL_ATTENTION, SLIDING_ATTENTION, LINEAR_ATTENTION})
        if unknown:
            raise ModelLoadError(f"unsupported layer type {unknown[0]!r} in layer_types")
        if LINEAR_ATTENTION in self.layer_types:
            self._check_linear_attention()

    @property
    def is_moe(self) -> bool:
        """Whether any decoder layer routes tokens to experts instead of one dense MLP."""
        return any(self.sparse_layer(i) for i in range(self.num_layers))

    def sparse_layer(self, index: int) -> bool:
        """Whether decoder layer `index` has the mixture-of-experts block (the rule of transformers' Qwen3-MoE
        and Qwen3-Next)."""
        return (
            self.num_experts > 0
            and index not in self.mlp_only_layers
            and (index + 1) % self.decoder_sparse_step == 0
        )

    def _check_linear_attention(self) -> None:
        if self.architecture not in HYBRID_ARCHITECTURES:
            raise ModelLoadError(f"{self.architecture} models have no linear-attention layers")
        sizes = (
            self.linear_num_key_heads, self.linear_num_value_heads, self.linear_key_head_dim,
            self.linear_value_head_dim, self.linear_conv_kernel,
        )
        if min(sizes) <= 0:
            raise ModelLoadError("linear-attention layers need positive head counts, head dims and conv kernel size")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ModelLoadError(
                f"{self.linear_num_value_heads} linear-attention value heads do not divide into "
                f"{self.linear_num_key_heads} key heads"
            )

    @property
    def attention_scale(self) -> float:
        base = self.query_pre_attn_scalar if self.query_pre_attn_scalar else self.head_dim
        return 1.0 / math.sqrt(base)

    @property
    def norm_adds_one(self) -> bool:
        """Gemma's RMSNorm multiplies by (1 + weight) in the HF convention."""
        return self.architecture in ("gemma3", "qwen3_5", "qwen3_next")

    @property
    def is_hybrid(self) -> bool:
        """Some layers keep a recurrent state (linear attention): rollback and batching need that state too."""
        return LINEAR_ATTENTION in self.layer_types

    @property
    def rotary_dim(self) -> int:
        """Channels of each head that RoPE rotates (the rest pass through unrotated)."""
        return int(self.head_dim * self.partial_rotary_factor)

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
                qk_norm=arch in ("qwen3", "gemma3", "qwen3_moe", "qwen3_5", "qwen3_next"),
                query_pre_attn_scalar=float(raw["query_pre_attn_scalar"]) if is_gemma else None,
                embed_scale=math.sqrt(hidden) if is_gemma else 1.0,
                final_logit_softcapping=_opt_float(raw.get("final_logit_softcapping")),
                attn_logit_softcapping=_opt_float(raw.get("attn_logit_softcapping")),
                bos_token_id=raw.get("bos_token_id"),
                eos_token_ids=eos_ids,
                **(_hybrid_fields(raw) if arch in HYBRID_ARCHITECTURES else {}),
                **(_moe_fields(raw, arch) if arch in MOE_ARCHITECTURES else {}),
            )
        except KeyError as exc:
            raise ModelLoadError(f"{source}: missing required field {exc.args[0]!r}") from None


def _moe_fields(raw: dict[str, Any], arch: str) -> dict[str, Any]:
    """The mixture-of-experts fields of a config (transformers 5 saves Qwen3-MoE's expert count as
    `num_local_experts`).

    Qwen3-Next's configuration class has a default for every expert field (512 experts, 10 per token, width 512,
    normalised routing, shared expert of width 512) that a config.json may leave out; Qwen3-MoE's must state its
    experts' sizes."""
    defaults: dict[str, Any] = (
        {"num_experts": 512, "num_experts_per_tok": 10, "moe_intermediate_size": 512, "norm_topk_prob": True}
        if arch == "qwen3_next"
        else {"num_experts": 0, "norm_topk_prob": False}
    )

    def field(key: str) -> Any:
        if raw.get(key) is not None:
            return raw[key]
        return defaults[key]  # a KeyError names the missing field

    experts = raw.get("num_experts", raw.get("num_local_experts"))
    experts = int(defaults["num_experts"] if experts is None else experts)
    if not experts:
        return {}
    fields: dict[str, Any] = {
        "num_experts": experts,
        "num_experts_per_tok": int(field("num_experts_per_tok")),
        "moe_intermediate_size": int(field("moe_intermediate_size")),
        "norm_topk_prob": bool(field("norm_topk_prob")),
        "decoder_sparse_step": int(raw.get("decoder_sparse_step") or 1),
        "mlp_only_layers": tuple(int(i) for i in raw.get("mlp_only_layers") or ()),
    }
    if arch == "qwen3_next":
        shared = raw.get("shared_expert_intermediate_size")
        fields["shared_expert_intermediate_size"] = int(512 if shared is None else shared)
    return fields


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


def _hybrid_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """Qwen3.5's gated attention and Gated DeltaNet sizes (transformers' defaults where a field is absent)."""
    params = raw.get("rope_parameters") if isinstance(raw.get("rope_parameters"), dict) else {}
    assert isinstance(params, dict)
    return {
        "partial_rotary_factor": float(raw.get("partial_rotary_factor") or params.get("partial_rotary_factor") or 0.25),
        "attention_output_gate": True,
        "linear_num_key_heads": int(raw.get("linear_num_key_heads", 16)),
        "linear_num_value_heads": int(raw.get("linear_num_value_heads", 32)),
        "linear_key_head_dim": int(raw.get("linear_key_head_dim", 128)),
        "linear_value_head_dim": int(raw.get("linear_value_head_dim", 128)),
        "linear_conv_kernel": int(raw.get("linear_conv_kernel_dim", 4)),
    }


def _opt_float(value: Any) -> float | None:
    return float(value) if value is not None else None


def _layer_types(raw: dict[str, Any], arch: str, layers: int) -> tuple[str, ...]:
    if raw.get("layer_types"):
        return tuple(str(t) for t in raw["layer_types"])
    if arch in HYBRID_ARCHITECTURES:  # every `full_attention_interval`-th layer is full attention, the others linear
        interval = int(raw.get("full_attention_interval", 4))
        return tuple(FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(layers))
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
