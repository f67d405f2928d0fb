"""The drafter on the quantized CPU kernel (Q8_0 blocks): close to the dense drafter, and speculative decoding
with it still gives exactly the target's own greedy output."""

from __future__ import annotations

import copy

import pytest
import torch
from gguf import GGMLQuantizationType
from torch import nn

from dflash.drafter.quantize import q8_0_matrix, quantize_drafter
from dflash.engine.loading import LoadOptions, load_engine
from dflash.errors import DFlashError
from dflash.kernels.build import KernelUnavailable, load_quant_kernel
from dflash.models.quantized_layers import QuantizedLinear, uses_quantized_weights
from tests.spec_helpers import assert_drafts_like, assert_speculation_lossless, golden_pair

try:
    load_quant_kernel()
except KernelUnavailable as exc:  # no compiler here: the CPU kernel's own tests say why
    pytest.skip(f"quantized CPU kernel unavailable: {exc}", allow_module_level=True)


def test_q8_0_blocks_round_trip_within_half_a_step() -> None:
    """Error per weight: half a step from rounding, plus up to 127 steps times the fp16 rounding of the scale."""
    weight = torch.randn(64, 96) * torch.linspace(0.01, 3.0, 64)[:, None]  # [rows, columns]
    matrix = q8_0_matrix(weight)
    assert matrix.qtype == GGMLQuantizationType.Q8_0 and matrix.shape == (64, 96)
    back = load_quant_kernel().dequantize(matrix.blocks, int(matrix.qtype), 96)  # [64, 96]
    step = weight.view(64, 3, 32).abs().amax(-1, keepdim=True) / 127  # one scale per block of 32
    error = (back.view(64, 3, 32) - weight.view(64, 3, 32)).abs()
    assert (error <= step * (0.5 + 127 * 2**-11) + 1e-7).all()
    assert error.max() > 0.1 * step.min()  # really rounded: not a lossless copy


def test_quantized_drafter_drafts_like_the_dense_one() -> None:
    target, dense = golden_pair()
    quantized = copy.deepcopy(dense)
    linears = sum(isinstance(m, nn.Linear) for m in dense.modules())
    assert quantize_drafter(quantized) == linears
    assert uses_quantized_weights(quantized) and not any(isinstance(m, nn.Linear) for m in quantized.modules())
    assert all(m.qtype == int(GGMLQuantizationType.Q8_0) for m in quantized.modules() if isinstance(m, QuantizedLinear))
    assert_drafts_like(target, dense, quantized)


def test_speculation_with_the_quantized_drafter_is_lossless() -> None:
    target, dense = golden_pair()
    quantized = copy.deepcopy(dense)
    quantize_drafter(quantized)
    assert_speculation_lossless(target, quantized)


def test_quantized_drafter_needs_float32_on_the_cpu() -> None:
    _, dense = golden_pair()
    with pytest.raises(ValueError, match="float32 drafter on the CPU"):
        quantize_drafter(copy.deepcopy(dense).to(torch.bfloat16))
    with pytest.raises(DFlashError, match="--draft-weights quantized runs on the CPU kernel in float32"):
        load_engine("default", "default",
                    loading=LoadOptions(device="cpu", dtype="bfloat16", draft_weights="quantized"))
    with pytest.raises(DFlashError, match="unknown --draft-weights"):
        load_engine("default", "default", loading=LoadOptions(device="cpu", draft_weights="int4"))


def test_stacked_projections_compute_what_the_separate_ones_do() -> None:
    """quantize_drafter stacks [q; k; v], [k; v] and [gate; up] into one product each: every output column is
    computed from its own weight row, so a stacked product is bitwise the separate ones side by side. (The
    drafter's logits then differ only by the fused SiLU * up, which rounds differently from torch's.)"""
    target, dense = golden_pair()
    quantized = copy.deepcopy(dense)
    quantize_drafter(quantized)
    x = torch.randn(5, quantized.config.hidden_size)
    with torch.inference_mode():
        for layer in quantized.layers:
            attention, mlp = layer.self_attn, layer.mlp
            assert attention.qkv_proj is not None and attention.kv_proj is not None and mlp.gate_up_proj is not None
            assert torch.equal(attention.qkv_proj(x), torch.cat([attention.q_proj(x), attention.k_proj(x),
                                                                 attention.v_proj(x)], -1))
            assert torch.equal(attention.kv_proj(x), torch.cat([attention.k_proj(x), attention.v_proj(x)], -1))
            assert torch.equal(mlp.gate_up_proj(x), torch.cat([mlp.gate_proj(x), mlp.up_proj(x)], -1))
        features = torch.randn(1, 40, quantized.config.feature_size)
        stacked = quantized.draft_scores(target, 7, 40, features, quantized.new_cache(80)).full()
        for layer in quantized.layers:
            layer.self_attn.kv_proj = layer.self_attn.qkv_proj = layer.mlp.gate_up_proj = None
        separate = quantized.draft_scores(target, 7, 40, features, quantized.new_cache(80)).full()
    torch.testing.assert_close(stacked, separate, rtol=1e-4, atol=1e-4)
