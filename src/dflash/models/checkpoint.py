"""What a loaded model is: configuration, weights under Hugging Face names, tokenizer, and origin.

Every loader (Hugging Face directory, GGUF file) produces a `Checkpoint` in the same convention:
parameter names as in transformers (`model.layers.0.self_attn.q_proj.weight`), RoPE in the
rotate-half layout, Gemma norms stored as HF stores them (the layer multiplies by `1 + weight`), the
experts of mixture-of-experts layers stacked per projection (`dflash.models.moe_weights`), and
no `lm_head.weight` when the embeddings are tied. `expected_shapes` is the list of tensors a model
needs; `validate_weights` checks a weight dictionary against it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from dflash.config import LINEAR_ATTENTION, ModelConfig
from dflash.errors import ModelLoadError
from dflash.models.gemma4_shapes import gemma4_shapes
from dflash.tokenizer import Tokenizer

__all__ = ["Checkpoint", "expected_shapes", "validate_weights"]


@dataclass
class Checkpoint:
    """A model ready to be instantiated: `weights` are keyed by Hugging Face parameter names."""

    config: ModelConfig
    weights: dict[str, torch.Tensor]
    tokenizer: Tokenizer | None
    source: Path


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the model needs, by Hugging Face name, with its shape."""
    if config.architecture == "gemma4":
        return gemma4_shapes(config)
    hidden, inter = config.hidden_size, config.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, hidden)}
    norms = ["input_layernorm", "post_attention_layernorm"]
    if config.architecture == "gemma3":
        norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        if config.layer_types[i] == LINEAR_ATTENTION:
            shapes.update(_linear_attention_shapes(config, p + "linear_attn."))
        else:
            _add_attention_shapes(shapes, config, p + "self_attn.")
        if config.sparse_layer(i):
            shapes.update(_moe_shapes(config, p + "mlp."))
        else:
            shapes.update(_mlp_shapes(hidden, inter, p + "mlp."))
        for norm in norms:
            shapes[p + norm + ".weight"] = (hidden,)
    shapes["model.norm.weight"] = (hidden,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    return shapes


def _add_attention_shapes(shapes: dict[str, tuple[int, ...]], config: ModelConfig, p: str) -> None:
    hidden, hd = config.hidden_size, config.head_dim
    q_out, kv_out = config.num_heads * hd, config.num_kv_heads * hd
    # a gated attention's query projection also yields the gate: per head, head_dim query then head_dim gate rows
    shapes[p + "q_proj.weight"] = (2 * q_out if config.attention_output_gate else q_out, hidden)
    shapes[p + "k_proj.weight"] = (kv_out, hidden)
    shapes[p + "v_proj.weight"] = (kv_out, hidden)
    shapes[p + "o_proj.weight"] = (hidden, q_out)
    if config.attention_bias:
        shapes[p + "q_proj.bias"] = (shapes[p + "q_proj.weight"][0],)
        shapes[p + "k_proj.bias"] = (kv_out,)
        shapes[p + "v_proj.bias"] = (kv_out,)
        shapes[p + "o_proj.bias"] = (hidden,)
    if config.qk_norm:
        shapes[p + "q_norm.weight"] = (hd,)
        shapes[p + "k_norm.weight"] = (hd,)


def _mlp_shapes(hidden: int, width: int, p: str) -> dict[str, tuple[int, ...]]:
    return {p + "gate_proj.weight": (width, hidden), p + "up_proj.weight": (width, hidden), p + "down_proj.weight": (hidden, width)}


def _moe_shapes(config: ModelConfig, p: str) -> dict[str, tuple[int, ...]]:
    """Router, experts stacked per projection (`dflash.models.moe_weights`) and, in Qwen3-Next, the shared expert
    with its gate."""
    hidden, experts, width = config.hidden_size, config.num_experts, config.moe_intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        p + "gate.weight": (experts, hidden),
        p + "experts.gate_proj": (experts, width, hidden),
        p + "experts.up_proj": (experts, width, hidden),
        p + "experts.down_proj": (experts, hidden, width),
    }
    if config.shared_expert_intermediate_size:
        shapes[p + "shared_expert_gate.weight"] = (1, hidden)
        shapes.update(_mlp_shapes(hidden, config.shared_expert_intermediate_size, p + "shared_expert."))
    return shapes


def _linear_attention_shapes(config: ModelConfig, p: str) -> dict[str, tuple[int, ...]]:
    """A Gated DeltaNet layer's tensors (transformers' names; Qwen3-Next fuses the projections per key head)."""
    hidden, kernel = config.hidden_size, config.linear_conv_kernel
    keys = config.linear_num_key_heads * config.linear_key_head_dim
    values = config.linear_num_value_heads * config.linear_value_head_dim
    heads = config.linear_num_value_heads
    projections: dict[str, tuple[int, ...]] = {
        p + "in_proj_qkv.weight": (2 * keys + values, hidden),
        p + "in_proj_z.weight": (values, hidden),
        p + "in_proj_b.weight": (heads, hidden),
        p + "in_proj_a.weight": (heads, hidden),
    }
    if config.architecture == "qwen3_next":
        projections = {
            p + "in_proj_qkvz.weight": (2 * keys + 2 * values, hidden),
            p + "in_proj_ba.weight": (2 * heads, hidden),
        }
    return {
        **projections,
        p + "conv1d.weight": (2 * keys + values, 1, kernel),
        p + "dt_bias": (heads,),
        p + "A_log": (heads,),
        p + "norm.weight": (config.linear_value_head_dim,),
        p + "out_proj.weight": (hidden, values),
    }


def validate_weights(config: ModelConfig, weights: dict[str, torch.Tensor], source: Path | str) -> None:
    """Raise `ModelLoadError` naming `source` for the first missing tensor or shape mismatch.

    Tensors the model does not use are not an error here; loaders drop them.
    """
    shapes = expected_shapes(config)
    missing = [name for name in shapes if name not in weights]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ModelLoadError(
            f"{source}: missing tensor {missing[0]!r}{more} for a {config.architecture} model "
            f"with {config.num_layers} layers"
        )
    for name, shape in shapes.items():
        actual = tuple(weights[name].shape)
        if actual != shape:
            raise ModelLoadError(
                f"{source}: tensor {name!r} has shape {list(actual)} but the configuration implies {list(shape)}"
            )
