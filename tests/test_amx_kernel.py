"""The AMX kernel (`--cpu-matmul amx`): bf16 products of the reference weights, float32 sums, batch invariance,
errors; the choice between kernels; speculative decoding on the default model under it. Skipped where the CPU has
no AMX tiles (the choice tests run everywhere)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from dflash.engine.engine import AMX_DDTREE_BUDGET, DEFAULT_DDTREE_BUDGET, EngineOptions
from dflash.engine.loading import LoadOptions, load_engine
from dflash.errors import ModelLoadError
from dflash.generation.request import GenerationRequest
from dflash.kernels.build import AmxKernel, load_amx_kernel
from dflash.models import cpu_matmul
from dflash.models.quantized_layers import QuantizedLinear
from dflash.models.quantized_weights import QuantizedMatrix
from tests.test_quantized_kernel import (  # noqa: F401
    Q4_1,
    Q8_0,
    check_refusals,
    quantized_blocks,
    raw_blocks,
    two_threads,
)

# Relative to max |y|: float32 sums in another order than the float64 reference, nothing else.
TOLERANCE = 1e-5

needs_amx = pytest.mark.skipif(cpu_matmul.amx_obstacle() is not None, reason="no AMX tiles on this CPU")


@pytest.fixture(scope="module")
def kernel() -> AmxKernel:
    return load_amx_kernel()


def bf16_weights(blocks: np.ndarray, qtype: GGMLQuantizationType) -> torch.Tensor:
    """The reference float32 weights rounded to bf16 (round to nearest even), as float64 [N, K]."""
    return torch.from_numpy(dequantize(blocks, qtype)).to(torch.bfloat16).double()


@needs_amx
@pytest.mark.parametrize("qtype", [Q4_1, Q8_0])
def test_each_weight_is_the_bf16_of_the_reference_value(kernel: AmxKernel, qtype: GGMLQuantizationType) -> None:
    """Unit input rows pick single weights: y[j, n] = bf16(W[n, j]) exactly (one product, no rounding in sums)."""
    blocks = raw_blocks(37, 64, qtype, seed=3)
    y = kernel.matmul(torch.eye(64), torch.from_numpy(blocks), int(qtype))  # [64, 37]
    assert torch.equal(y.double().T, bf16_weights(blocks, qtype))


@needs_amx
@pytest.mark.parametrize("qtype", [Q4_1, Q8_0])
@pytest.mark.parametrize(("rows", "columns", "inputs"), [(1, 32, 1), (37, 96, 5), (101, 576, 16), (53, 1536, 40),
                                                         (48, 160, 120)])
def test_matmul_matches_the_bf16_product(
    kernel: AmxKernel, qtype: GGMLQuantizationType, rows: int, columns: int, inputs: int
) -> None:
    for make in (quantized_blocks, raw_blocks):
        blocks = make(rows, columns, qtype, seed=rows + columns)
        x = torch.randn(inputs, columns, generator=torch.Generator().manual_seed(inputs))
        y = kernel.matmul(x, torch.from_numpy(blocks), int(qtype))
        reference = x.to(torch.bfloat16).double() @ bf16_weights(blocks, qtype).T
        scale = reference.abs().max().item()
        assert (y.double() - reference).abs().max().item() <= TOLERANCE * scale


@needs_amx
@pytest.mark.usefixtures("two_threads")
@pytest.mark.parametrize("qtype", [Q4_1, Q8_0])
def test_every_row_is_bitwise_the_row_alone(kernel: AmxKernel, qtype: GGMLQuantizationType) -> None:
    """Rows of 1-, 5-, 16-, 17-, 97- (past the six groups one pass holds) and 200-row products, on one and two
    threads, equal the one-row products bitwise: what lets a verification reproduce plain decoding."""
    blocks = torch.from_numpy(quantized_blocks(83, 576, qtype, seed=7))
    x = torch.randn(200, 576, generator=torch.Generator().manual_seed(0))
    alone = torch.cat([kernel.matmul(x[i : i + 1], blocks, int(qtype)) for i in range(200)])
    for m in (1, 5, 16, 17, 97, 200):
        assert torch.equal(kernel.matmul(x[:m], blocks, int(qtype)), alone[:m]), m
    torch.set_num_threads(1)
    assert torch.equal(kernel.matmul(x[:16], blocks, int(qtype)), alone[:16])


@needs_amx
def test_bad_inputs_are_refused(kernel: AmxKernel) -> None:
    check_refusals(kernel)
    blocks = torch.from_numpy(quantized_blocks(16, 64, Q8_0, seed=0))
    assert kernel.matmul(torch.randn(0, 64), blocks, int(Q8_0)).shape == (0, 16)


def test_choice_follows_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    assert cpu_matmul.choose_cpu_matmul("float32").kind == "float32"
    monkeypatch.setattr(cpu_matmul, "amx_obstacle", lambda: "no tiles here")
    monkeypatch.setattr(cpu_matmul, "int8_obstacle", lambda: "no AVX2 here")
    assert cpu_matmul.choose_cpu_matmul("auto") == cpu_matmul.MatmulChoice("float32", "auto: no tiles here; no AVX2 here")
    monkeypatch.setattr(cpu_matmul, "int8_obstacle", lambda: None)
    assert cpu_matmul.choose_cpu_matmul("auto").kind == "int8x2"  # without tiles, speculating or not
    assert cpu_matmul.choose_cpu_matmul("auto", speculative=False).kind == "int8x2"
    with pytest.raises(ModelLoadError, match="--cpu-matmul amx is not available: no tiles here"):
        cpu_matmul.choose_cpu_matmul("amx")
    with pytest.raises(ModelLoadError, match="unknown --cpu-matmul 'bf16'"):
        cpu_matmul.choose_cpu_matmul("bf16")
    monkeypatch.setattr(cpu_matmul, "amx_obstacle", lambda: None)
    assert cpu_matmul.choose_cpu_matmul("auto").kind == "amx"  # verified rows cost about one on the tiles
    assert cpu_matmul.choose_cpu_matmul("auto", speculative=False).kind == "int8x2"  # one row per step


def test_unknown_products_are_refused() -> None:
    matrix = QuantizedMatrix(torch.from_numpy(quantized_blocks(4, 32, Q8_0, seed=0)), Q8_0, 32)
    with pytest.raises(ValueError, match="unknown products"):
        QuantizedLinear(matrix).use_products("int4")


def test_a_chosen_tree_budget_is_kept_and_float32_products_keep_the_cpu_default() -> None:
    chosen = load_engine("default", "default", options=EngineOptions(ddtree_budget=5),
                         loading=LoadOptions(device="cpu", cpu_matmul="float32"))
    assert chosen.options.ddtree_budget == 5
    plain = load_engine("default", "default", loading=LoadOptions(device="cpu", cpu_matmul="float32"))
    assert plain.options.ddtree_budget == DEFAULT_DDTREE_BUDGET["cpu"]


@needs_amx
def test_default_model_under_amx_products() -> None:
    """The whole default model on AMX products: logits close to the float32 kernel's, every quantized matrix
    (target, drafter, the drafter's shortlist head) on the AMX kernel, and speculative decoding (linear and
    DDTree with 15 nodes, one 16-row tile) exactly plain decoding."""
    engine = load_engine("default", "default", loading=LoadOptions(device="cpu", cpu_matmul="amx"))
    assert engine.cpu_matmul == "amx" and engine.drafter is not None
    assert engine.options.ddtree_budget == AMX_DDTREE_BUDGET  # the default tree on AMX products
    modules = [*engine.target.modules(), *engine.drafter.modules(), *(engine.drafter.draft_head.modules()
                                                                      if engine.drafter.draft_head else [])]
    products = {m.products for m in modules if isinstance(m, QuantizedLinear)}
    assert products == {"amx"}
    exact = load_engine("default", "none", loading=LoadOptions(device="cpu", cpu_matmul="float32"))
    ids = engine.chat_prompt_ids([{"role": "user", "content": "Write a Python function that reverses a list."}])
    with torch.inference_mode():
        got, want = engine.target(torch.tensor([ids])).logits, exact.target(torch.tensor([ids])).logits
    assert got is not None and want is not None
    # bf16 products move logits by a few hundredths at most (magnitudes up to about 30)
    assert (got - want).abs().max().item() < 0.5
    assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() > 0.95
    plain = engine.generate(GenerationRequest(prompt_ids=ids, max_new_tokens=64), spec="none")
    for spec, budget in (("linear", None), ("ddtree", 15)):
        engine.options = dataclasses.replace(engine.options, ddtree_budget=budget or engine.options.ddtree_budget)
        out = engine.generate(GenerationRequest(prompt_ids=ids, max_new_tokens=64), spec=spec)
        assert out.token_ids == plain.token_ids, spec
