"""The mixture-of-experts side of llama.cpp's hybrid GGUFs: Qwen3-Next (`qwen3next`) and Qwen3.5-MoE (`qwen35moe`).

Both store the routed experts stacked per projection (`ffn_{gate,up,down}_exps`, [experts, out, in] in torch order,
or gate and up joined as `ffn_gate_up_exps`), the router as `ffn_gate_inp`, and the shared expert with its sigmoid
gate as `ffn_{gate,up,down}_shexp` and `ffn_gate_inp_shexp` (a [hidden] or [1, hidden] row). Qwen3-Next's converter
also splits transformers' per-key-head `in_proj_qkvz` into `attn_qkv` (every q head, every k head, every v head)
and `attn_gate` (z), while `ssm_ba` keeps transformers' `in_proj_ba` as it is; `join_projections` rebuilds
`in_proj_qkvz`, so the checkpoint holds exactly transformers' tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from dflash.config import LINEAR_ATTENTION, ModelConfig
from dflash.errors import ModelLoadError
from dflash.models.moe_weights import stack_expert_weights

__all__ = ["EXPERT_PARAMETERS", "MOE_LAYER_NAMES", "join_projections", "moe_fields"]

# llama.cpp tensor stem -> transformers layer part (stacked experts keep transformers' suffix-less names)
MOE_LAYER_NAMES = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ssm_ba": "linear_attn.in_proj_ba",
}
EXPERT_PARAMETERS = {
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_up_exps": "mlp.experts.gate_up_proj",
}


def moe_fields(
    gguf_arch: str, layers: int, get: Callable[..., Any], need: Callable[[str], int],
    tensor_shapes: dict[str, tuple[int, ...]] | Any, source: Path,
) -> dict[str, Any]:
    """Expert settings of a `qwen3next` / `qwen35moe` file. As for `qwen3moe`, a layer is sparse exactly when it has
    a router; Qwen3.5-MoE has no dense layers, and its router always rescales the top-k weights."""
    sizes = {
        "num_experts": need("expert_count"),
        "num_experts_per_tok": need("expert_used_count"),
        "moe_intermediate_size": need("expert_feed_forward_length"),
        "shared_expert_intermediate_size": need("expert_shared_feed_forward_length"),
    }
    dense = tuple(i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensor_shapes)
    every_layer = gguf_arch == "qwen35moe"
    if every_layer and dense:
        raise ModelLoadError(f"{source}: layer {dense[0]} of a {gguf_arch} file has no router (ffn_gate_inp)")
    return {
        **sizes,
        "norm_topk_prob": True if every_layer else bool(get("expert_weights_norm", True)),
        "decoder_sparse_step": 1,
        "mlp_only_layers": dense,
    }


def join_projections(
    config: ModelConfig, weights: dict[str, torch.Tensor], source: Path | str
) -> dict[str, torch.Tensor]:
    """`weights` with joined gate/up experts split (`stack_expert_weights`) and, for Qwen3-Next, each linear layer's
    `in_proj_qkv` and `in_proj_z` joined back into transformers' `in_proj_qkvz`. Works on meta tensors too (the
    loader checks shapes before reading any data)."""
    out = stack_expert_weights(config, weights, source) if config.is_moe else dict(weights)
    if config.architecture != "qwen3_next":
        return out
    key_heads, key_dim = config.linear_num_key_heads, config.linear_key_head_dim
    served = config.linear_num_value_heads // key_heads * config.linear_value_head_dim  # value rows per key head
    for i, kind in enumerate(config.layer_types):
        p = f"model.layers.{i}.linear_attn."
        if kind != LINEAR_ATTENTION or p + "in_proj_qkv.weight" not in out or p + "in_proj_z.weight" not in out:
            continue  # a missing tensor is reported by the shape check
        qkv, z = out.pop(p + "in_proj_qkv.weight"), out.pop(p + "in_proj_z.weight")
        hidden = qkv.shape[-1]
        if qkv.shape[0] != 2 * key_heads * key_dim + key_heads * served or z.shape[0] != key_heads * served:
            raise ModelLoadError(f"{source}: layer {i}: attn_qkv / attn_gate have {qkv.shape[0]} / {z.shape[0]} rows, "
                                 "which the linear-attention head sizes do not explain")
        q, k, v = qkv.split((key_heads * key_dim, key_heads * key_dim, key_heads * served))
        per_head = [t.reshape(key_heads, -1, hidden) for t in (q, k, v, z)]  # [key_heads, rows, hidden] each
        out[p + "in_proj_qkvz.weight"] = torch.cat(per_head, dim=1).reshape(-1, hidden)
    return out
