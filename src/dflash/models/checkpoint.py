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

from dflash.config import ModelConfig
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
    hidden, inter, hd = config.hidden_size, config.intermediate_size, config.head_dim
    q_out, kv_out = config.num_heads * hd, config.num_kv_heads * hd
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, hidden)}
    norms = ["input_layernorm", "post_attention_layernorm"]
    if config.architecture == "gemma3":
        norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "self_attn.q_proj.weight"] = (q_out, hidden)
        shapes[p + "self_attn.k_proj.weight"] = (kv_out, hidden)
        shapes[p + "self_attn.v_proj.weight"] = (kv_out, hidden)
        shapes[p + "self_attn.o_proj.weight"] = (hidden, q_out)
        if config.attention_bias:
            shapes[p + "self_attn.q_proj.bias"] = (q_out,)
            shapes[p + "self_attn.k_proj.bias"] = (kv_out,)
            shapes[p + "self_attn.v_proj.bias"] = (kv_out,)
            shapes[p + "self_attn.o_proj.bias"] = (hidden,)
        if config.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (hd,)
            shapes[p + "self_attn.k_norm.weight"] = (hd,)
        if config.sparse_layer(i):  # experts stacked per projection (`dflash.models.moe_weights`)
            experts, width = config.num_experts, config.moe_intermediate_size
            shapes[p + "mlp.gate.weight"] = (experts, hidden)
            shapes[p + "mlp.experts.gate_proj"] = (experts, width, hidden)
            shapes[p + "mlp.experts.up_proj"] = (experts, width, hidden)
            shapes[p + "mlp.experts.down_proj"] = (experts, hidden, width)
        else:
            shapes[p + "mlp.gate_proj.weight"] = (inter, hidden)
            shapes[p + "mlp.up_proj.weight"] = (inter, hidden)
            shapes[p + "mlp.down_proj.weight"] = (hidden, inter)
        for norm in norms:
            shapes[p + norm + ".weight"] = (hidden,)
    shapes["model.norm.weight"] = (hidden,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    return shapes


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
