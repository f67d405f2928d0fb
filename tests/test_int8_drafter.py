"""The drafter with int8 rows (`Int8Linear`, `quantize_drafter_int8`): the rounding stays within half a step, the
module multiplies like the widened matrix, the fused drafter joins int8 layers without copies, and speculative
decoding with the rounded drafter still gives exactly the target's own greedy output."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dflash.drafter.int8 import quantize_drafter_int8
from dflash.engine.loading import _drafter_weight_format
from dflash.errors import DFlashError
from dflash.fastpath.fused_drafter import fuse_drafter_weights
from dflash.fastpath.fused_layers import apply_linear
from dflash.models.int8_linear import Int8Linear, int8_rows
from tests.spec_helpers import assert_drafts_like, assert_speculation_lossless, golden_pair


def test_int8_rows_round_within_half_a_step() -> None:
    weight = torch.randn(48, 80) * torch.linspace(0.01, 3.0, 48)[:, None]  # [rows, columns]
    weight[5] = 0.0
    values, scales = int8_rows(weight)
    assert values.dtype == torch.int8 and scales.shape == (48,) and values.abs().max() <= 127
    step = weight.abs().amax(dim=1) / 127  # [rows]
    error = (values.float() * scales[:, None] - weight).abs()
    assert (error <= step[:, None] * 0.5 + 1e-6).all()
    assert error.max() > 0.1 * step[step > 0].min()  # really rounded
    assert torch.equal(values[5], torch.zeros(80, dtype=torch.int8))


def test_int8_linear_multiplies_like_the_widened_matrix() -> None:
    linear = nn.Linear(64, 24)
    module = Int8Linear.from_linear(linear)
    widened = module.values.float() * module.scales[:, None]  # [24, 64]
    x = torch.randn(2, 3, 64)
    torch.testing.assert_close(module(x), F.linear(x, widened, linear.bias), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(module(x), linear(x), rtol=0.05, atol=0.05)
    assert module.weight.numel() == 0 and module.weight.dtype == torch.float32  # dtype / device probes keep working


def test_stacked_int8_layers_share_memory_with_their_parts() -> None:
    parts = [Int8Linear.from_linear(nn.Linear(32, rows, bias=False)) for rows in (16, 8, 8)]
    alone = [part(torch.ones(1, 32)) for part in parts]
    joined = Int8Linear.stacked(parts)
    assert joined.out_features == 32 and joined.values.data_ptr() == parts[0].values.data_ptr()
    assert parts[1].values.data_ptr() == joined.values[16:].data_ptr()
    torch.testing.assert_close(joined(torch.ones(1, 32)), torch.cat(alone, dim=-1))
    with pytest.raises(ValueError, match="bias-free"):
        Int8Linear.stacked([Int8Linear.from_linear(nn.Linear(32, 4))])


def test_int8_drafter_drafts_like_the_dense_one_and_speculation_stays_lossless() -> None:
    target, dense = golden_pair()
    rounded = copy.deepcopy(dense)
    assert quantize_drafter_int8(rounded) == sum(isinstance(m, nn.Linear) for m in dense.modules())
    assert not any(isinstance(m, nn.Linear) for m in rounded.modules())
    assert_drafts_like(target, dense, rounded)
    assert_speculation_lossless(target, rounded)


def test_a_shortlist_head_is_rounded_too() -> None:
    target, shared = golden_pair()
    drafter = copy.deepcopy(shared)
    drafter.use_draft_vocab(torch.arange(0, target.config.vocab_size, 3), target)
    linears = sum(isinstance(m, nn.Linear) for m in drafter.modules())
    assert quantize_drafter_int8(drafter) == linears + 1
    assert drafter.draft_head is not None and isinstance(drafter.draft_head.rows, Int8Linear)


def test_the_fused_drafter_joins_int8_layers() -> None:
    drafter = copy.deepcopy(golden_pair()[1])
    quantize_drafter_int8(drafter)
    first = drafter.layers[0].self_attn
    x = torch.randn(3, drafter.config.hidden_size)
    separate = torch.cat([first.q_proj(x), first.k_proj(x), first.v_proj(x)], dim=-1)
    fused = fuse_drafter_weights(drafter)
    joined = fused.qkv[0]
    assert isinstance(joined, Int8Linear) and first.k_proj.values.data_ptr() == joined.values[
        first.q_proj.out_features :
    ].data_ptr()
    torch.testing.assert_close(apply_linear(x, joined), separate)
    assert len(fused.gate_up) == len(drafter.layers)


def test_draft_weight_formats_by_device() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert _drafter_weight_format("auto", "quantized", cpu, torch.float32) == "q8_0"
    assert _drafter_weight_format("auto", "dense", cpu, torch.float32) == "dense"
    assert _drafter_weight_format("quantized", "dense", cpu, torch.float32) == "q8_0"
    assert _drafter_weight_format("quantized", "dense", cuda, torch.bfloat16) == "int8"
    assert _drafter_weight_format("auto", "dense", cuda, torch.bfloat16) == "int8"
    assert _drafter_weight_format("auto", "dense", cuda, torch.float32) == "dense"
    assert _drafter_weight_format("dense", "quantized", cpu, torch.float32) == "dense"
    with pytest.raises(DFlashError, match="on a GPU in bfloat16/float16"):
        _drafter_weight_format("quantized", "dense", cuda, torch.float32)
    with pytest.raises(DFlashError, match="unknown --draft-weights"):
        _drafter_weight_format("int4", "dense", cpu, torch.float32)
