"""A transformers Qwen3.5 hybrid written the way llama.cpp's converter writes it (`qwen35` GGUF tensors and
metadata), for the loaders' tests."""

from __future__ import annotations

from typing import Any

import numpy as np

from tests.loading_helpers import gguf_tokenizer_metadata, train_byte_level_tokenizer

HYBRID_NAMES = {  # transformers layer part -> llama.cpp tensor stem
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "linear_attn.in_proj_qkv": "attn_qkv", "linear_attn.in_proj_z": "attn_gate", "linear_attn.in_proj_b": "ssm_beta",
    "linear_attn.in_proj_a": "ssm_alpha", "linear_attn.conv1d": "ssm_conv1d", "linear_attn.norm": "ssm_norm",
    "linear_attn.out_proj": "ssm_out",
}


def tiled_rows(rows: np.ndarray, groups: int, per_group: int, head_rows: int) -> np.ndarray:
    """Value-head rows from transformers' grouped order to llama.cpp's tiled order."""
    shaped = rows.reshape(groups, per_group, head_rows, *rows.shape[1:])
    return shaped.swapaxes(0, 1).reshape(rows.shape)


def convert_hybrid(hf: Any) -> dict[str, np.ndarray]:
    """The model's tensors as llama.cpp's converter writes them (see `dflash.models.gguf_hybrid`)."""
    out: dict[str, np.ndarray] = {}
    for name, tensor in hf.state_dict().items():
        w = tensor.detach().float().numpy()
        if name == "model.embed_tokens.weight":
            out["token_embd.weight"] = w
        elif name == "model.norm.weight":
            out["output_norm.weight"] = w + 1
        elif name == "lm_head.weight":
            out["output.weight"] = w
        else:
            block, part = name.removeprefix("model.layers.").split(".", 1)
            if part.startswith("linear_attn.") and part != "linear_attn.norm.weight":
                stem, w = converted_linear_attention(hf.config, part, w, tiled=True)
            else:
                stem_name, suffix = part.rsplit(".", 1)
                stem = f"{HYBRID_NAMES[stem_name]}.{suffix}"
                if stem_name.endswith("norm") and stem_name != "linear_attn.norm":
                    w = w + 1
            out[f"blk.{block}.{stem}"] = w
    return out


def converted_linear_attention(cfg: Any, part: str, w: np.ndarray, tiled: bool) -> tuple[str, np.ndarray]:
    """A DeltaNet tensor `part` (its name within the layer) as the converter writes it -> (GGUF name within the
    block, tensor); `tiled`: value heads in llama.cpp's tiled order (Qwen3.5's converter; Qwen3-Next's keeps them)."""
    groups, per_group = cfg.linear_num_key_heads, cfg.linear_num_value_heads // cfg.linear_num_key_heads
    q_and_k, head_v = 2 * groups * cfg.linear_key_head_dim, cfg.linear_value_head_dim

    def tile(rows: np.ndarray, head_rows: int) -> np.ndarray:
        return tiled_rows(rows, groups, per_group, head_rows) if tiled else rows

    if part == "linear_attn.A_log":
        return "ssm_a", tile(-np.exp(w)[:, None], 1)[:, 0]
    if part == "linear_attn.dt_bias":
        return "ssm_dt.bias", tile(w[:, None], 1)[:, 0]
    stem, suffix = part.rsplit(".", 1)
    if stem == "linear_attn.conv1d":
        w = w[:, 0]
    if stem in ("linear_attn.in_proj_qkv", "linear_attn.conv1d"):
        w = np.concatenate((w[:q_and_k], tile(w[q_and_k:], head_v)))
    elif stem == "linear_attn.in_proj_z":
        w = tile(w, head_v)
    elif stem in ("linear_attn.in_proj_b", "linear_attn.in_proj_a"):
        w = tile(w, 1)
    elif stem == "linear_attn.out_proj":
        w = tile(w.T, head_v).T
    return f"{HYBRID_NAMES[stem]}.{suffix}", w


def hybrid_metadata(hf: Any, mtp_layers: int, arch: str = "qwen35", dense_width: bool = True) -> dict[str, Any]:
    """The `{arch}.*` keys llama.cpp writes for the model (the width of dense MLPs where it has them), with a
    byte-level tokenizer's."""
    cfg = hf.config
    md = {
        f"{arch}.block_count": cfg.num_hidden_layers + mtp_layers,
        f"{arch}.nextn_predict_layers": mtp_layers,
        f"{arch}.context_length": 512,
        f"{arch}.embedding_length": cfg.hidden_size,
        **({f"{arch}.feed_forward_length": cfg.intermediate_size} if dense_width else {}),
        f"{arch}.attention.head_count": cfg.num_attention_heads,
        f"{arch}.attention.head_count_kv": cfg.num_key_value_heads,
        f"{arch}.attention.key_length": cfg.head_dim,
        f"{arch}.attention.value_length": cfg.head_dim,
        f"{arch}.attention.layer_norm_rms_epsilon": 1e-6,
        f"{arch}.rope.freq_base": 10000.0,
        f"{arch}.rope.dimension_count": cfg.head_dim // 4,
        f"{arch}.full_attention_interval": 4,
        f"{arch}.ssm.conv_kernel": cfg.linear_conv_kernel_dim,
        f"{arch}.ssm.state_size": cfg.linear_key_head_dim,
        f"{arch}.ssm.group_count": cfg.linear_num_key_heads,
        f"{arch}.ssm.time_step_rank": cfg.linear_num_value_heads,
        f"{arch}.ssm.inner_size": cfg.linear_value_head_dim * cfg.linear_num_value_heads,
    }
    return {**md, **gguf_tokenizer_metadata(train_byte_level_tokenizer())}
