"""Frozen model configuration shared by every architecture family.

`ModelConfig.from_hf` reads a Hugging Face `config.json` dictionary; the GGUF loader builds the same record
from GGUF metadata. Model code reads only this record, never the raw dictionaries.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from dflash.errors import ModelLoadError

SUPPORTED_ARCHITECTURES = (
    "llama", "qwen3", "gemma3", "qwen3_moe", "qwen3_5", "qwen3_next", "qwen3_5_moe", "gemma4",
)
# Families whose layers keep a recurrent state besides (or instead of) K/V: see `dflash.kv.recurrent`.
HYBRID_ARCHITECTURES = ("qwen3_5", "qwen3_next", "qwen3_5_moe")
# Families with a mixture of experts in (some of) their layers: `ModelConfig.sparse_layer` says which.
MOE_ARCHITECTURES = ("qwen3_moe", "qwen3_next", "qwen3_5_moe")

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
    "qwen3_5_moe": "qwen3_5_moe",
    "qwen3_5_moe_text": "qwen3_5_moe",
    "gemma4": "gemma4",
    "gemma4_text": "gemma4",
}


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a decoder-only transformer, normalised across families."""

    architecture: str  # one of SUPPORTED_ARCHITECTURES
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
    # Mixture of experts (Qwen3-MoE, Qwen3-Next, Qwen3.5-MoE): 0 experts means every layer has the dense MLP of
    # `intermediate_size`.
    num_experts: int = 0
    num_experts_per_tok: int = 0  # experts each token is routed to (top-k)
    moe_intermediate_size: int = 0  # width of one expert's gated MLP
    norm_topk_prob: bool = False  # rescale the top-k routing weights to sum to 1
    decoder_sparse_step: int = 1  # layer i is sparse when (i + 1) % step == 0 ...
    mlp_only_layers: tuple[int, ...] = ()  # ... and i is not listed here
    # Qwen3-Next and Qwen3.5-MoE add to every sparse layer a shared gated MLP of this width, scaled by a sigmoid gate (0: none)
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
    # Gemma 4 (`dflash.models.gemma4`); the defaults describe every other family.
    global_head_dim: int | None = None  # head width of the full-attention layers, when not head_dim
    global_num_kv_heads: int | None = None  # their key/value heads, when not num_kv_heads
    attention_k_eq_v: bool = False  # full-attention layers take their values from the key projection
    num_kv_shared_layers: int = 0  # the last N layers attend to the K/V of an earlier layer of their type
    double_wide_mlp: bool = False  # ... and then have an MLP of twice intermediate_size
    hidden_size_per_layer_input: int = 0  # width of each layer's per-layer input embedding (0: none)
    vocab_size_per_layer_input: int = 0  # rows of the per-layer input embedding table
    fixed_attention_scale: float | None = None  # the attention logit scale when it is not head_dim ** -0.5

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"unsupported architecture {self.architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if len(self.layer_types) != self.num_layers:
            raise ModelLoadError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(f"{self.num_heads} attention heads do not divide into {self.num_kv_heads} KV heads")
        if not 0 <= self.num_kv_shared_layers < self.num_layers:
            raise ModelLoadError(f"{self.num_kv_shared_layers} K/V-sharing layers of {self.num_layers} leave none to share")
        for index in range(self.num_layers - self.num_kv_shared_layers, self.num_layers):
            self.kv_source(index)  # raises when a layer type has no earlier layer to read from
        if self.num_experts:
            if not 0 < self.num_experts_per_tok <= self.num_experts:
                raise ModelLoadError(
                    f"{self.num_experts_per_tok} experts per token is not within 1..{self.num_experts} experts"
                )
            if self.moe_intermediate_size <= 0 or self.decoder_sparse_step <= 0:
                raise ModelLoadError("a mixture-of-experts model needs a positive expert width and sparse step")
        elif self.architecture == "qwen3_5_moe":  # every layer's MLP is the mixture: there is no dense one
            raise ModelLoadError("a qwen3_5_moe model needs at least one expert (num_experts)")
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
        if self.fixed_attention_scale is not None:
            return self.fixed_attention_scale
        base = self.query_pre_attn_scalar if self.query_pre_attn_scalar else self.head_dim
        return 1.0 / math.sqrt(base)

    def layer_head_dim(self, index: int) -> int:
        """Head width of decoder layer `index` (Gemma 4's full-attention layers may be wider)."""
        if self.global_head_dim is not None and self.layer_types[index] == FULL_ATTENTION:
            return self.global_head_dim
        return self.head_dim

    def layer_kv_heads(self, index: int) -> int:
        """Key/value heads of decoder layer `index`."""
        if self.global_num_kv_heads is not None and self.layer_types[index] == FULL_ATTENTION:
            return self.global_num_kv_heads
        return self.num_kv_heads

    @property
    def cache_layers(self) -> int:
        """Layers a K/V cache holds rows for, numbered in layer order: neither the linear-attention layers (they keep
        a recurrent state instead) nor the K/V-sharing layers (the last ones, which read the rows of earlier
        layers)."""
        own = self.layer_types[: self.num_layers - self.num_kv_shared_layers]
        return len(own) - own.count(LINEAR_ATTENTION)

    @property
    def cache_head_dim(self) -> int:
        """Head width of a K/V cache that holds every layer (narrower layers use the first part of it)."""
        return max(self.layer_head_dim(i) for i in range(self.num_layers))

    @property
    def cache_kv_heads(self) -> int:
        """Key/value heads of a K/V cache that holds every layer (layers with fewer use the first ones)."""
        return max(self.layer_kv_heads(i) for i in range(self.num_layers))

    def kv_source(self, index: int) -> int:
        """The layer whose keys and values layer `index` attends to: itself, or for the last
        `num_kv_shared_layers` layers the last layer of the same type before them (transformers' Gemma 4 rule)."""
        first_shared = self.num_layers - self.num_kv_shared_layers
        if index < first_shared:
            return index
        kind = self.layer_types[index]
        for source in range(first_shared - 1, -1, -1):
            if self.layer_types[source] == kind:
                return source
        raise ModelLoadError(f"layer {index} ({kind}) shares K/V, but no earlier layer of that type computes them")

    def layer_intermediate_size(self, index: int) -> int:
        """MLP width of layer `index` (Gemma 4 doubles it in the K/V-sharing layers when `double_wide_mlp`)."""
        doubled = self.double_wide_mlp and self.kv_source(index) != index
        return self.intermediate_size * (2 if doubled else 1)

    @property
    def norm_adds_one(self) -> bool:
        """Gemma's RMSNorm multiplies by (1 + weight) in the HF convention."""
        return self.architecture in ("gemma3", *HYBRID_ARCHITECTURES)

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
                intermediate_size=_dense_width(raw, arch),
                num_layers=layers,
                num_heads=heads,
                num_kv_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=head_dim,
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=rope_theta,
                max_position_embeddings=int(raw.get("max_position_embeddings", 8192)),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", arch in ("gemma3", "gemma4"))),
                layer_types=layer_types,
                sliding_window=int(raw["sliding_window"]) if raw.get("sliding_window") else None,
                rope_scaling=rope_scaling,
                rope_local_theta=local_theta if arch in ("gemma3", "gemma4") else None,
                hidden_act=str(raw.get("hidden_activation") or raw.get("hidden_act") or "silu"),
                attention_bias=bool(raw.get("attention_bias", False)),
                qk_norm=arch in ("qwen3", "gemma3", "qwen3_moe", "gemma4", *HYBRID_ARCHITECTURES),
                query_pre_attn_scalar=float(raw["query_pre_attn_scalar"]) if is_gemma else None,
                embed_scale=math.sqrt(hidden) if arch in ("gemma3", "gemma4") else 1.0,
                final_logit_softcapping=_opt_float(raw.get("final_logit_softcapping")),
                attn_logit_softcapping=_opt_float(raw.get("attn_logit_softcapping")),
                bos_token_id=raw.get("bos_token_id"),
                eos_token_ids=eos_ids,
                **(_hybrid_fields(raw) if arch in HYBRID_ARCHITECTURES else {}),
                **(_moe_fields(raw, arch) if arch in MOE_ARCHITECTURES else {}),
                **(_gemma4_fields(raw, layer_types, head_dim, source) if arch == "gemma4" else {}),
            )
        except KeyError as exc:
            raise ModelLoadError(f"{source}: missing required field {exc.args[0]!r}") from None


def _dense_width(raw: dict[str, Any], arch: str) -> int:
    """The dense MLP's width. Qwen3.5-MoE has no dense MLP (every layer is sparse) and its configuration class has
    no such field; the others must state it."""
    if arch == "qwen3_5_moe":
        return int(raw.get("intermediate_size") or 0)
    return int(raw["intermediate_size"])


# Expert fields a config.json may leave out, per family: Qwen3-Next's and Qwen3.5-MoE's configuration classes have
# a default for each (Qwen3-MoE's must state its experts' sizes).
_MOE_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen3_moe": {"num_experts": 0, "norm_topk_prob": False},
    "qwen3_next": {
        "num_experts": 512, "num_experts_per_tok": 10, "moe_intermediate_size": 512, "norm_topk_prob": True,
        "shared_expert_intermediate_size": 512,
    },
    "qwen3_5_moe": {
        "num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 512, "norm_topk_prob": True,
        "shared_expert_intermediate_size": 512,
    },
}


def _moe_fields(raw: dict[str, Any], arch: str) -> dict[str, Any]:
    """The mixture-of-experts fields of a config (transformers 5 saves Qwen3-MoE's expert count as
    `num_local_experts`), with the family's defaults (`_MOE_DEFAULTS`) for absent ones.

    Qwen3.5-MoE's configuration class has no `decoder_sparse_step`, `mlp_only_layers` or `norm_topk_prob`: every
    layer is sparse and its router always rescales the top-k weights, whatever a config.json says."""
    defaults = _MOE_DEFAULTS[arch]

    def field(key: str) -> Any:
        if raw.get(key) is not None:
            return raw[key]
        return defaults[key]  # a KeyError names the missing field

    experts = raw.get("num_experts", raw.get("num_local_experts"))
    experts = int(defaults["num_experts"] if experts is None else experts)
    if not experts:
        return {}
    every_layer = arch == "qwen3_5_moe"
    fields: dict[str, Any] = {
        "num_experts": experts,
        "num_experts_per_tok": int(field("num_experts_per_tok")),
        "moe_intermediate_size": int(field("moe_intermediate_size")),
        "norm_topk_prob": True if every_layer else bool(field("norm_topk_prob")),
        "decoder_sparse_step": 1 if every_layer else int(raw.get("decoder_sparse_step") or 1),
        "mlp_only_layers": () if every_layer else tuple(int(i) for i in raw.get("mlp_only_layers") or ()),
    }
    if "shared_expert_intermediate_size" in defaults:
        fields["shared_expert_intermediate_size"] = int(field("shared_expert_intermediate_size"))
    return fields


def _gemma4_fields(raw: dict[str, Any], layer_types: tuple[str, ...], head_dim: int, source: str) -> dict[str, Any]:
    """The Gemma 4 fields of a text config, read as transformers' `Gemma4TextConfig` reads them: the full-attention
    layers' head width and K/V heads come from `per_layer_config` (what transformers writes) or from
    `global_head_dim` / `num_global_key_value_heads` (what released checkpoints declare)."""
    if raw.get("enable_moe_block"):
        raise ModelLoadError(f"{source}: Gemma 4 mixture-of-experts models (enable_moe_block) are not supported")
    if raw.get("use_bidirectional_attention") == "all":
        raise ModelLoadError(f"{source}: Gemma 4 with bidirectional attention over every token is not a causal LM")
    local = (raw.get("rope_parameters") or {}).get(SLIDING_ATTENTION) or {}
    if local.get("rope_type", "default") != "default":
        raise ModelLoadError(f"{source}: RoPE type {local['rope_type']!r} on sliding layers is not supported")
    k_eq_v = bool(raw.get("attention_k_eq_v", False))
    kv_heads = int(raw.get("num_key_value_heads") or raw["num_attention_heads"])
    full = [i for i, kind in enumerate(layer_types) if kind == FULL_ATTENTION]
    overrides: dict[int, dict[str, Any]]
    if isinstance(raw.get("per_layer_config"), dict):
        overrides = {int(k): dict(v or {}) for k, v in raw["per_layer_config"].items()}
    else:
        wide: dict[str, Any] = {"head_dim": int(raw.get("global_head_dim") or 512)}  # transformers' default
        if k_eq_v and raw.get("num_global_key_value_heads"):
            wide["num_key_value_heads"] = int(raw["num_global_key_value_heads"])
        overrides = dict.fromkeys(full, wide)
    dims = {i: (int(overrides.get(i, {}).get("head_dim", head_dim)),
                int(overrides.get(i, {}).get("num_key_value_heads", kv_heads))) for i in range(len(layer_types))}
    full_dims = {dims[i] for i in full} or {(head_dim, kv_heads)}
    if len(full_dims) > 1 or any(dims[i] != (head_dim, kv_heads) for i in dims if i not in full):
        raise ModelLoadError(f"{source}: per-layer head sizes other than one per attention type are not supported")
    (global_head_dim, global_kv_heads), = full_dims
    per_layer = int(raw.get("hidden_size_per_layer_input") or 0)
    return {
        "global_head_dim": global_head_dim,
        "global_num_kv_heads": global_kv_heads,
        "attention_k_eq_v": k_eq_v,
        "num_kv_shared_layers": int(raw.get("num_kv_shared_layers") or 0),
        "double_wide_mlp": bool(raw.get("use_double_wide_mlp", False)),
        "hidden_size_per_layer_input": per_layer,
        "vocab_size_per_layer_input": int(raw.get("vocab_size_per_layer_input") or raw["vocab_size"]) if per_layer else 0,
        "fixed_attention_scale": 1.0,  # the q/k norms set the logits' scale
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
    kinds = _declared_layer_types(raw, arch, layers)
    if arch == "gemma4" and kinds and kinds[-1] != FULL_ATTENTION:  # transformers forces a full last layer
        kinds = (*kinds[:-1], FULL_ATTENTION)
    return kinds


def _declared_layer_types(raw: dict[str, Any], arch: str, layers: int) -> tuple[str, ...]:
    if raw.get("layer_types"):
        return tuple(str(t) for t in raw["layer_types"])
    if arch in HYBRID_ARCHITECTURES:  # every `full_attention_interval`-th layer is full attention, the others linear
        interval = int(raw.get("full_attention_interval", 4))
        return tuple(FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(layers))
    if arch in ("gemma3", "gemma4"):
        pattern = int(raw.get("sliding_window_pattern", 6))
        return tuple(FULL_ATTENTION if (i + 1) % pattern == 0 else SLIDING_ATTENTION for i in range(layers))
    if arch == "qwen3_moe":  # transformers' Qwen3-MoE windows every layer when it windows at all
        sliding = bool(raw.get("use_sliding_window") and raw.get("sliding_window"))
        return (SLIDING_ATTENTION if sliding else FULL_ATTENTION,) * layers
    if raw.get("use_sliding_window") and raw.get("sliding_window"):
        first_full = int(raw.get("max_window_layers", layers))
        return tuple(SLIDING_ATTENTION if i >= first_full else FULL_ATTENTION for i in range(layers))
    return (FULL_ATTENTION,) * layers
