"""The tensors of a Gemma 4 text checkpoint, by Hugging Face name, with their shapes.

They differ from the other families' layer by layer: full-attention layers may have wider heads and fewer K/V
heads, take their values from the key projection (no `v_proj`), and K/V-sharing layers have neither key nor value
projections nor their norms (and, with `double_wide_mlp`, an MLP twice as wide). Per-layer inputs add a second
embedding table, a projection and a norm to the model, and a gate, a projection and a norm to every layer.
"""

from __future__ import annotations

from dflash.config import FULL_ATTENTION, ModelConfig

__all__ = ["gemma4_shapes"]


def gemma4_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    hidden, per_layer = config.hidden_size, config.hidden_size_per_layer_input
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, hidden)}
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        head_dim, inter = config.layer_head_dim(i), config.layer_intermediate_size(i)
        q_out, kv_out = config.num_heads * head_dim, config.layer_kv_heads(i) * head_dim
        projections = {"q": q_out, "o": hidden}
        if config.kv_source(i) == i:
            projections["k"] = kv_out
            shapes[p + "self_attn.k_norm.weight"] = (head_dim,)
            if not (config.attention_k_eq_v and config.layer_types[i] == FULL_ATTENTION):
                projections["v"] = kv_out
        for name, rows in projections.items():
            shapes[p + f"self_attn.{name}_proj.weight"] = (rows, q_out if name == "o" else hidden)
            if config.attention_bias:
                shapes[p + f"self_attn.{name}_proj.bias"] = (rows,)
        shapes[p + "self_attn.q_norm.weight"] = (head_dim,)
        shapes[p + "mlp.gate_proj.weight"] = (inter, hidden)
        shapes[p + "mlp.up_proj.weight"] = (inter, hidden)
        shapes[p + "mlp.down_proj.weight"] = (hidden, inter)
        for norm in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            shapes[p + norm + ".weight"] = (hidden,)
        shapes[p + "layer_scalar"] = (1,)
        if per_layer:
            shapes[p + "per_layer_input_gate.weight"] = (per_layer, hidden)
            shapes[p + "per_layer_projection.weight"] = (hidden, per_layer)
            shapes[p + "post_per_layer_input_norm.weight"] = (hidden,)
    if per_layer:
        packed = config.num_layers * per_layer
        shapes["model.embed_tokens_per_layer.weight"] = (config.vocab_size_per_layer_input, packed)
        shapes["model.per_layer_model_projection.weight"] = (packed, hidden)
        shapes["model.per_layer_projection_norm.weight"] = (per_layer,)
    shapes["model.norm.weight"] = (hidden,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    return shapes
