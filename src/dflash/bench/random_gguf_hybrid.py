"""The Qwen3.5 hybrid shapes of `dflash bench make-gguf`: llama.cpp's `qwen35` tensors and metadata.

Three of every four layers are Gated DeltaNet (`attn_qkv`, `attn_gate`, `ssm_beta`, `ssm_alpha`, `ssm_out`, with
the convolution kernel, decay and bias vectors and the gated norm in float32), the fourth gated attention (`attn_q`
holds query and gate rows); every layer has a dense SiLU MLP. llama.cpp's Q4_K_M rule treats `attn_qkv` as it
treats `attn_v` (one such matrix per layer: Q6_K in the layers `more_bits` picks, Q4_K elsewhere), and `ffn_down`
likewise; the rest is Q4_K and the output matrix Q6_K.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter

from dflash.bench.gguf_shapes import HybridShape, add_decoder_metadata

F32 = GGMLQuantizationType.F32
TensorList = list[tuple[str, tuple[int, int], GGMLQuantizationType]]


def hybrid_layer_tensors(
    shape: HybridShape, layer: int, base: GGMLQuantizationType, rich: GGMLQuantizationType
) -> TensorList:
    """(GGUF name, (rows, columns), format) of one layer's tensors; 1-D ones as (1, length)."""
    h, p = shape.hidden, f"blk.{layer}."
    value_size = shape.value_heads * shape.value_dim
    if shape.is_linear(layer):
        mixer = [
            (p + "attn_qkv.weight", (shape.conv_channels, h), rich),
            (p + "attn_gate.weight", (value_size, h), base),
            (p + "ssm_beta.weight", (shape.value_heads, h), base),
            (p + "ssm_alpha.weight", (shape.value_heads, h), base),
            (p + "ssm_conv1d.weight", (shape.conv_channels, shape.conv_kernel), F32),
            (p + "ssm_a", (1, shape.value_heads), F32),
            (p + "ssm_dt.bias", (1, shape.value_heads), F32),
            (p + "ssm_norm.weight", (1, shape.value_dim), F32),
            (p + "ssm_out.weight", (h, value_size), base),
        ]
    else:
        q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
        mixer = [
            (p + "attn_q.weight", (2 * q, h), base),  # query and gate rows per head
            (p + "attn_k.weight", (kv, h), base),
            (p + "attn_v.weight", (kv, h), rich),
            (p + "attn_output.weight", (h, q), base),
            (p + "attn_q_norm.weight", (1, shape.head_dim), F32),
            (p + "attn_k_norm.weight", (1, shape.head_dim), F32),
        ]
    return [
        (p + "attn_norm.weight", (1, h), F32),
        *mixer,
        (p + "post_attention_norm.weight", (1, h), F32),
        (p + "ffn_gate.weight", (shape.intermediate, h), base),
        (p + "ffn_up.weight", (shape.intermediate, h), base),
        (p + "ffn_down.weight", (h, shape.intermediate), rich),
    ]


def hybrid_float_tensor(name: str, dims: tuple[int, int], rng: np.random.Generator) -> np.ndarray:
    """A float32 tensor of a hybrid: norms near 1 (llama.cpp stores 1 + transformers' weight, except the gated
    norm's), decays -exp(A_log) < 0 with slow memory, small time-step biases and convolution taps."""
    rows, columns = dims
    if name.endswith(".ssm_a"):
        return -rng.uniform(0.02, 0.3, columns).astype(np.float32)
    if name.endswith(".ssm_dt.bias"):
        return (0.1 * rng.standard_normal(columns)).astype(np.float32)
    if name.endswith(".ssm_conv1d.weight"):
        return (0.3 * rng.standard_normal((rows, columns))).astype(np.float32)
    return (1.0 + 0.1 * rng.standard_normal(columns)).astype(np.float32)


def add_hybrid_metadata(writer: GGUFWriter, shape: HybridShape) -> None:
    """The `qwen35.*` keys llama.cpp and `dflash.models.gguf_hybrid` read (block count and the rest)."""
    arch = "qwen35"
    add_decoder_metadata(writer, shape, context=262144, rope_base=10_000_000.0)
    writer.add_rope_dimension_count(shape.rotary_dim)
    pairs = shape.rotary_dim // 2  # the multimodal rope sections of a text-only model: positions equal in each
    writer.add_array(f"{arch}.rope.dimension_sections", [pairs - 2 * (pairs // 3), pairs // 3, pairs // 3, 0])
    writer.add_uint32(f"{arch}.full_attention_interval", shape.interval)
    writer.add_uint32(f"{arch}.ssm.conv_kernel", shape.conv_kernel)
    writer.add_uint32(f"{arch}.ssm.state_size", shape.key_dim)
    writer.add_uint32(f"{arch}.ssm.group_count", shape.key_heads)
    writer.add_uint32(f"{arch}.ssm.time_step_rank", shape.value_heads)
    writer.add_uint32(f"{arch}.ssm.inner_size", shape.value_heads * shape.value_dim)
