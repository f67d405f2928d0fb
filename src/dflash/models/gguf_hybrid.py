"""GGUF files of the Qwen3.5 hybrid models (llama.cpp architectures `qwen35`, `qwen35moe` and `qwen3next`):
configuration, tensor names, and the inverse of llama.cpp's conversion.

llama.cpp's converter changes the Gated DeltaNet weights as well as renaming them, and we undo each change:
  * every RMSNorm weight except the DeltaNet's gated norm (`ssm_norm`) had 1 added (HF scales by 1 + weight);
  * `A_log` became ssm_a = -exp(A_log); `dt_bias` became `ssm_dt.bias`;
  * the convolution kernel lost its middle axis ([channels, 1, kernel] -> [channels, kernel]);
  * Qwen3.5 and Qwen3.5-MoE only: when there are more value heads than key heads, the value heads were put in
    "tiled" order (for each head
    within a group, every group: v0 of groups 0, 1, ..., then v1 of groups 0, 1, ...) instead of transformers'
    grouped order (all heads of group 0, then group 1, ...), in every tensor indexed by value head: the v rows
    of `attn_qkv` and of the convolution, `attn_gate` (z), `ssm_beta`, `ssm_alpha`, `ssm_a`, `ssm_dt` and the
    input columns of `ssm_out`.
A file may also carry multi-token-prediction blocks after the model's own (`nextn_predict_layers`): they are
skipped. The experts, and Qwen3-Next's split projections, are in `dflash.models.gguf_hybrid_moe`.

Matrices kept as quantized blocks (`hybrid_block_rows`) take the row reorders on their bytes (rows are independent
in every block format); `ssm_out`'s reordered input columns cannot be moved inside blocks, so it keeps them and
names the order its input must be put in instead.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from dflash.config import FULL_ATTENTION, LINEAR_ATTENTION, ModelConfig
from dflash.errors import ModelLoadError
from dflash.models.gguf_hybrid_moe import EXPERT_PARAMETERS, MOE_LAYER_NAMES, moe_fields

__all__ = [
    "GGUF_HYBRID_ARCHITECTURES",
    "hybrid_block_rows",
    "hybrid_config_from_gguf",
    "hybrid_hf_shape",
    "hybrid_tensor_name",
    "undo_hybrid_conversion",
]

# llama.cpp's name -> ours
GGUF_HYBRID_ARCHITECTURES = {"qwen35": "qwen3_5", "qwen35moe": "qwen3_5_moe", "qwen3next": "qwen3_next"}
_MOE_ARCHITECTURES = ("qwen35moe", "qwen3next")

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",  # query and gate rows, per head, as in transformers
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_qkv": "linear_attn.in_proj_qkv",
    "attn_gate": "linear_attn.in_proj_z",
    "ssm_beta": "linear_attn.in_proj_b",
    "ssm_alpha": "linear_attn.in_proj_a",
    "ssm_conv1d": "linear_attn.conv1d",
    "ssm_norm": "linear_attn.norm",
    "ssm_out": "linear_attn.out_proj",
    **MOE_LAYER_NAMES,
}
# HF names without a suffix
_PARAMETERS = {"ssm_a": "linear_attn.A_log", "ssm_dt": "linear_attn.dt_bias", **EXPERT_PARAMETERS}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+?)(?:\.(weight|bias))?")


def hybrid_tensor_name(gguf_name: str, num_layers: int) -> str | None:
    """The transformers name of a hybrid's tensor; "" for a tensor to skip (multi-token-prediction blocks), None
    for one the model does not have."""
    block_prefix = re.match(r"blk\.(\d+)\.", gguf_name)
    if block_prefix is not None and int(block_prefix[1]) >= num_layers:
        return ""
    match = _BLOCK_RE.fullmatch(gguf_name)
    if match is None:
        return None
    block, stem, kind = int(match[1]), match[2], match[3]
    if stem in _PARAMETERS and kind in (None, "weight", "bias"):
        return f"model.layers.{block}.{_PARAMETERS[stem]}"
    part = _LAYER_NAMES.get(stem)
    return f"model.layers.{block}.{part}.{kind}" if part and kind else None


def hybrid_hf_shape(gguf_name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The transformers shape of a tensor stored with `shape` (the convolution kernel regains its middle axis, the
    shared expert's gate is one row)."""
    if ".ssm_conv1d." in gguf_name and len(shape) == 2:
        return (shape[0], 1, shape[1])
    if ".ffn_gate_inp_shexp." in gguf_name and len(shape) == 1:
        return (1, shape[0])
    return shape


def undo_hybrid_conversion(tensor: torch.Tensor, gguf_name: str, config: ModelConfig) -> torch.Tensor:
    """One dequantised hybrid tensor back in transformers' convention (see the module docstring)."""
    stem = gguf_name.split(".")[2] if gguf_name.startswith("blk.") else gguf_name
    if gguf_name.endswith("norm.weight") and stem != "ssm_norm":
        return tensor - 1.0
    if stem == "ssm_a":
        tensor = torch.log(-tensor)
    if stem == "ffn_gate_inp_shexp":
        return tensor.reshape(1, -1)
    if config.architecture == "qwen3_next":  # its converter keeps transformers' value-head order
        return tensor.reshape(tensor.shape[0], 1, -1) if stem == "ssm_conv1d" else tensor
    regroup = _Regroup(config)
    if stem == "attn_qkv":
        q_and_k = 2 * config.linear_num_key_heads * config.linear_key_head_dim
        return torch.cat((tensor[:q_and_k], regroup(tensor[q_and_k:], config.linear_value_head_dim)))
    if stem == "ssm_conv1d":
        q_and_k = 2 * config.linear_num_key_heads * config.linear_key_head_dim
        kernel = tensor.reshape(tensor.shape[0], 1, -1)  # [channels, 1, kernel]
        return torch.cat((kernel[:q_and_k], regroup(kernel[q_and_k:], config.linear_value_head_dim)))
    if stem == "attn_gate":
        return regroup(tensor, config.linear_value_head_dim)
    if stem in ("ssm_beta", "ssm_alpha", "ssm_a", "ssm_dt"):
        return regroup(tensor, 1)
    if stem == "ssm_out":
        return regroup(tensor.transpose(0, 1), config.linear_value_head_dim).transpose(0, 1).contiguous()
    return tensor


def hybrid_block_rows(
    blocks: torch.Tensor, gguf_name: str, config: ModelConfig
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One quantized hybrid matrix, blocks [rows, bytes per row], in transformers' row order -> (blocks, input
    order): the input order [columns] long is None, or for `ssm_out` (columns still in llama.cpp's tiled order)
    the model's input feature each stored column multiplies (y = W_stored @ x[order])."""
    stem = gguf_name.split(".")[2] if gguf_name.startswith("blk.") else gguf_name
    if config.architecture == "qwen3_next" or stem not in ("attn_qkv", "attn_gate", "ssm_beta", "ssm_alpha", "ssm_out"):
        return blocks, None
    regroup = _Regroup(config)
    if stem == "ssm_out":
        if regroup.per_group == 1:
            return blocks, None
        value_size = config.linear_num_value_heads * config.linear_value_head_dim
        grouped = torch.arange(value_size).reshape(regroup.groups, regroup.per_group, config.linear_value_head_dim)
        return blocks, grouped.transpose(0, 1).reshape(-1)  # stored (head in group, group) <- model's (group, head)
    return undo_hybrid_conversion(blocks, gguf_name, config), None


class _Regroup:
    """Rows of value heads from llama.cpp's tiled order back to transformers' grouped order."""

    def __init__(self, config: ModelConfig) -> None:
        self.groups = config.linear_num_key_heads
        self.per_group = config.linear_num_value_heads // max(1, config.linear_num_key_heads)

    def __call__(self, rows: torch.Tensor, head_rows: int) -> torch.Tensor:
        if self.per_group == 1:
            return rows
        rest = rows.shape[1:]
        tiled = rows.reshape(self.per_group, self.groups, head_rows, *rest)  # [head in group, group, ...]
        return tiled.transpose(0, 1).reshape(rows.shape).contiguous()


def hybrid_config_from_gguf(
    gguf_arch: str, metadata: Mapping[str, Any], tensor_shapes: Mapping[str, tuple[int, ...]], source: Path
) -> ModelConfig:
    """The configuration of a hybrid GGUF (metadata keys under `{gguf_arch}.`, as llama.cpp writes them)."""

    def get(key: str, default: Any = None) -> Any:
        return metadata.get(f"{gguf_arch}.{key}", default)

    def need(key: str) -> int:
        value = get(key)
        if value is None:
            raise ModelLoadError(f"{source}: GGUF metadata lacks {gguf_arch}.{key}")
        return _one_value(value, f"{gguf_arch}.{key}", source)

    layers = need("block_count") - int(get("nextn_predict_layers", 0) or 0)
    is_moe = gguf_arch in _MOE_ARCHITECTURES
    hidden, heads = need("embedding_length"), need("attention.head_count")
    head_dim = int(get("attention.key_length") or hidden // heads)
    value_heads = need("ssm.time_step_rank")
    interval = int(get("full_attention_interval", 4) or 4)
    embed = tensor_shapes.get("token_embd.weight")
    if embed is None or len(embed) != 2:
        raise ModelLoadError(f"{source}: GGUF file has no 2-D token_embd.weight tensor")
    eos, bos = metadata.get("tokenizer.ggml.eos_token_id"), metadata.get("tokenizer.ggml.bos_token_id")
    return ModelConfig(
        architecture=GGUF_HYBRID_ARCHITECTURES[gguf_arch],
        vocab_size=int(embed[0]),
        hidden_size=hidden,
        # Qwen3.5-MoE has no dense MLP, so its files have no dense width
        intermediate_size=(
            _one_value(get("feed_forward_length"), f"{gguf_arch}.feed_forward_length", source)
            if get("feed_forward_length") or not is_moe else 0
        ),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=_one_value(get("attention.head_count_kv", heads), f"{gguf_arch}.attention.head_count_kv", source),
        head_dim=head_dim,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        max_position_embeddings=int(get("context_length", 32768)),
        tie_word_embeddings="output.weight" not in tensor_shapes,
        layer_types=tuple(FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(layers)),
        qk_norm=True,
        bos_token_id=int(bos) if bos is not None else None,
        eos_token_ids=(int(eos),) if eos is not None else (),
        partial_rotary_factor=int(get("rope.dimension_count") or head_dim // 4) / head_dim,
        attention_output_gate=True,
        linear_num_key_heads=need("ssm.group_count"),
        linear_num_value_heads=value_heads,
        linear_key_head_dim=need("ssm.state_size"),
        linear_value_head_dim=need("ssm.inner_size") // value_heads,
        linear_conv_kernel=need("ssm.conv_kernel"),
        **(moe_fields(gguf_arch, layers, get, need, tensor_shapes, source) if is_moe else {}),
    )


def _one_value(value: Any, key: str, source: Path) -> int:
    """A per-model integer llama.cpp may store per layer; the linear layers' zeros (no attention heads) aside, every
    layer must agree."""
    if isinstance(value, list):
        distinct = {int(v) for v in value if int(v)}
        if len(distinct) != 1:
            raise ModelLoadError(f"{source}: {key} differs between layers ({sorted(distinct)}); not supported")
        return distinct.pop()
    return int(value)
