"""The int8-inputs kernel (`--cpu-matmul int8`): the inputs' quantisation, the products against the dequantised
weights (exactly those of the quantised inputs; within a derived bound of the float32 inputs'), batch invariance,
errors, the narrower instruction sets; speculative decoding on the default model under it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from dflash.engine.engine import AMX_DDTREE_BUDGET, DEFAULT_DDTREE_BUDGET, Engine, EngineOptions
from dflash.engine.loading import LoadOptions, load_engine
from dflash.errors import ModelLoadError
from dflash.generation.request import GenerationRequest
from dflash.kernels.build import Int8Kernel, load_int8_kernel
from dflash.models import cpu_matmul
from dflash.models.quantized_layers import QuantizedLinear
from tests.test_quantized_kernel import (  # noqa: F401
    Q4_1,
    Q8_0,
    check_refusals,
    quantized_blocks,
    raw_blocks,
    two_threads,
)

# Relative to max |y|: float32 sums in another order than the float64 reference (as the float32 kernel's).
SUM_TOLERANCE = 1e-5

needs_int8 = pytest.mark.skipif(cpu_matmul.int8_obstacle() is not None, reason="no int8 dot products on this CPU")


@pytest.fixture(scope="module")
def kernel() -> Int8Kernel:
    return load_int8_kernel()


def reference_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The quantisation the kernel promises, in numpy float32: per block of 32, d = max|x| / 127 and
    q = round-half-even(x * (127 / max|x|)) (0 where the block is all zeros)."""
    blocks = x.numpy().reshape(x.shape[0], -1, 32)
    amax = np.abs(blocks).max(axis=-1, keepdims=True)  # [M, K / 32, 1] float32
    with np.errstate(divide="ignore"):
        inverse = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.rint(blocks * inverse).astype(np.int8).reshape(x.shape)
    return torch.from_numpy(q), torch.from_numpy((amax[..., 0] / np.float32(127)).astype(np.float32))


def dequantized_inputs(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return (q.double().view(q.shape[0], -1, 32) * scales.double().unsqueeze(-1)).view(q.shape)  # [M, K]


def weights_of(blocks: np.ndarray, qtype: GGMLQuantizationType) -> torch.Tensor:
    return torch.from_numpy(dequantize(blocks, qtype)).double()  # [N, K]


def rounding_bound(x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """|y - x @ W^T| from the inputs' rounding alone: each q is within half a step (d / 2 = max|x_b| / 254) of
    x / d, so block b of an output moves by at most max|x_b| / 254 * sum_{j in b} |W[n, j]|. [M, N]"""
    half_step = x.double().abs().view(x.shape[0], -1, 32).amax(-1) / 254  # [M, K / 32]
    weight_mass = weights.abs().view(weights.shape[0], -1, 32).sum(-1)  # [N, K / 32]
    return half_step @ weight_mass.T


@needs_int8
def test_inputs_are_quantised_as_promised(kernel: Int8Kernel) -> None:
    x = torch.randn(9, 160, generator=torch.Generator().manual_seed(0)) * 4
    x[2, 32:64] = 0  # an all-zero block: scale 0, values 0
    x[3, :32] = torch.arange(32) - 15.5  # ties at x * 127 / max = k + 0.5 round to even
    q, scales = kernel.quantize(x)
    want_q, want_scales = reference_quantize(x)
    assert torch.equal(q, want_q) and torch.equal(scales, want_scales)
    assert q.abs().max().item() == 127 and scales[2, 1].item() == 0


@needs_int8
@pytest.mark.parametrize("qtype", [Q4_1, Q8_0])
@pytest.mark.parametrize(("rows", "columns"), [(1, 32), (37, 96), (101, 576), (53, 1536), (19, 1568)])
def test_matmul_is_the_product_of_the_quantised_inputs(
    kernel: Int8Kernel, qtype: GGMLQuantizationType, rows: int, columns: int
) -> None:
    """y equals dequant(int8 x) @ W^T up to float32 summation order, and x @ W^T within the rounding bound.
    Odd block counts (1, 3, 49) take the half-empty last step; 37, 101, 53, 19 rows leave tile remainders."""
    for make in (quantized_blocks, raw_blocks):
        blocks = make(rows, columns, qtype, seed=rows + columns)
        weights = weights_of(blocks, qtype)
        generator = torch.Generator().manual_seed(rows)
        for m in (1, 2, 5, 7, 16, 17, 70):
            x = torch.randn(m, columns, generator=generator) * 2
            y = kernel.matmul(x, torch.from_numpy(blocks), int(qtype))
            assert y.shape == (m, rows) and y.dtype == torch.float32
            q, scales = kernel.quantize(x)
            exact = dequantized_inputs(q, scales) @ weights.T
            scale = exact.abs().max().item()
            assert (y.double() - exact).abs().max().item() <= SUM_TOLERANCE * scale
            slack = SUM_TOLERANCE * (x.double() @ weights.T).abs().max().item()
            assert ((y.double() - x.double() @ weights.T).abs() <= rounding_bound(x, weights) + slack).all()


@needs_int8
@pytest.mark.usefixtures("two_threads")
@pytest.mark.parametrize("qtype", [Q4_1, Q8_0])
@pytest.mark.parametrize("columns", [576, 608])  # 18 blocks; 19 (a half-empty last step)
def test_every_row_is_bitwise_the_row_alone(kernel: Int8Kernel, qtype: GGMLQuantizationType, columns: int) -> None:
    """Row i of an M-row product equals the product of row i alone, for the row counts of plain steps,
    verifications and prefill chunks, on two threads and one."""
    blocks = torch.from_numpy(quantized_blocks(203, columns, qtype, seed=7))  # odd N: tail rows of every tile
    x = torch.randn(150, columns, generator=torch.Generator().manual_seed(0)) * 3.0
    alone = torch.cat([kernel.matmul(x[i : i + 1], blocks, int(qtype)) for i in range(x.shape[0])])
    for m in (2, 3, 4, 5, 6, 7, 8, 9, 13, 16, 17, 33, 64, 65, 150):
        assert torch.equal(kernel.matmul(x[:m], blocks, int(qtype)), alone[:m]), m
    assert torch.equal(kernel.matmul(x[5:22], blocks, int(qtype)), alone[5:22])
    torch.set_num_threads(1)
    assert torch.equal(kernel.matmul(x[:17], blocks, int(qtype)), alone[:17])


@needs_int8
@pytest.mark.parametrize("qtype", [Q4_1, Q8_0])
def test_tiles_and_vectors_give_the_same_bits(kernel: Int8Kernel, qtype: GGMLQuantizationType) -> None:
    """Where the CPU has AMX-INT8 tiles, products of 6 or more rows run on them and fewer on vectors: both paths
    compute each output's float chain alike, so either gives the same bits for every row count."""
    if not kernel.has_tiles():
        pytest.skip("no AMX-INT8 tiles here")
    blocks = torch.from_numpy(raw_blocks(37, 608, qtype, seed=3))  # 19 blocks, 37 rows: partial groups
    x = torch.randn(40, 608, generator=torch.Generator().manual_seed(4))
    for m in (2, 5, 6, 16, 17, 40):
        assert torch.equal(kernel.matmul(x[:m], blocks, int(qtype), tiles=False),
                           kernel.matmul(x[:m], blocks, int(qtype), tiles=True)), m


@needs_int8
def test_bad_inputs_are_refused(kernel: Int8Kernel) -> None:
    check_refusals(kernel)
    blocks = torch.from_numpy(quantized_blocks(16, 64, Q8_0, seed=0))
    with pytest.raises(RuntimeError, match="multiple of 32"):
        kernel.quantize(torch.randn(2, 40))
    assert kernel.matmul(torch.randn(0, 64), blocks, int(Q8_0)).shape == (0, 16)
    x = torch.randn(64, 3).T  # [3, 64], column-major
    assert torch.equal(kernel.matmul(x, blocks, int(Q8_0)), kernel.matmul(x.contiguous(), blocks, int(Q8_0)))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("flags", "isa"), [(("-mno-avx512f",), "avx-vnni"), (("-mno-avx512f", "-mno-avxvnni"), "avx2"),
                       (("-mno-avx512f", "-mno-avxvnni", "-mno-avx2"), "none")]
)
def test_narrower_instruction_sets(flags: tuple[str, ...], isa: str) -> None:
    """The 256-bit builds (AVX-VNNI, AVX2's maddubs; chosen at compile time) quantise alike, give the products of
    the quantised inputs and the same invariance; without AVX2 the kernel says it is unavailable."""
    narrow = load_int8_kernel(flags)
    if isa == "avx-vnni" and narrow.isa() == "avx2":
        pytest.skip("the compiler targets no AVX-VNNI on this CPU")
    assert narrow.isa() == isa
    if isa == "none":
        assert not narrow.available()
        with pytest.raises(RuntimeError, match="int8 products need"):
            narrow.matmul(torch.randn(1, 32), torch.from_numpy(quantized_blocks(1, 32, Q8_0, seed=0)), int(Q8_0))
        return
    x = torch.randn(19, 224, generator=torch.Generator().manual_seed(2))
    q, scales = narrow.quantize(x)
    want_q, want_scales = reference_quantize(x)
    assert torch.equal(q, want_q) and torch.equal(scales, want_scales)
    for qtype in (Q4_1, Q8_0):
        blocks = raw_blocks(45, 224, qtype, seed=5)
        y = narrow.matmul(x, torch.from_numpy(blocks), int(qtype))
        exact = dequantized_inputs(q, scales) @ weights_of(blocks, qtype).T
        assert (y.double() - exact).abs().max().item() <= SUM_TOLERANCE * exact.abs().max().item()
        alone = torch.cat([narrow.matmul(x[i : i + 1], torch.from_numpy(blocks), int(qtype)) for i in range(19)])
        assert torch.equal(y, alone)


def test_choice_of_int8(monkeypatch: pytest.MonkeyPatch) -> None:
    """int8 only when asked (auto keeps amx / float32: the rounded inputs change answers)."""
    monkeypatch.setattr(cpu_matmul, "int8_obstacle", lambda: "no dot products here")
    with pytest.raises(ModelLoadError, match="--cpu-matmul int8 is not available: no dot products here"):
        cpu_matmul.choose_cpu_matmul("int8")
    monkeypatch.setattr(cpu_matmul, "int8_obstacle", lambda: None)
    monkeypatch.setattr(cpu_matmul, "amx_obstacle", lambda: None)
    assert cpu_matmul.choose_cpu_matmul("int8") == cpu_matmul.MatmulChoice("int8", "int8 products requested")
    assert cpu_matmul.choose_cpu_matmul("auto").kind == "amx"


def logits_beside_float32(engine: Engine) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """A coding prompt's ids and the target's logits [1, positions, vocab] under `engine`'s products and under the
    float32 kernel."""
    exact = load_engine("default", "none", loading=LoadOptions(device="cpu", cpu_matmul="float32"))
    ids = engine.chat_prompt_ids([{"role": "user", "content": "Write a Python function that reverses a list."}])
    with torch.inference_mode():
        got, want = engine.target(torch.tensor([ids])).logits, exact.target(torch.tensor([ids])).logits
    assert got is not None and want is not None
    return ids, got, want


def assert_speculation_is_plain(engine: Engine, ids: list[int], products: str) -> None:
    """Linear DFlash, and DDTree with 4 and 15 nodes (5 verified rows on the vector path, 16 on AMX-INT8 tiles where
    the CPU has them), give `engine`'s plain greedy tokens."""
    plain = engine.generate(GenerationRequest(prompt_ids=ids, max_new_tokens=64), spec="none")
    linear = engine.generate(GenerationRequest(prompt_ids=ids, max_new_tokens=64), spec="linear")
    assert linear.token_ids == plain.token_ids
    for budget in (4, 15):
        # a budget given at load: the engine's batch core keeps the budget it was created with
        tree = load_engine("default", "default", options=EngineOptions(ddtree_budget=budget),
                           loading=LoadOptions(device="cpu", cpu_matmul=products))
        out = tree.generate(GenerationRequest(prompt_ids=ids, max_new_tokens=64), spec="ddtree")
        assert out.token_ids == plain.token_ids, budget
        assert out.stats.rounds > 0


@needs_int8
def test_default_model_under_int8_products() -> None:
    """The whole default model on int8 products: logits close to the float32 kernel's, every quantized matrix
    (target, drafter, the drafter's shortlist head) on the int8 kernel, and speculative decoding (linear, and
    DDTree with 4 and 15 nodes) exactly plain decoding."""
    engine = load_engine("default", "default", loading=LoadOptions(device="cpu", cpu_matmul="int8"))
    assert engine.cpu_matmul == "int8" and engine.drafter is not None
    tiles = load_int8_kernel().has_tiles()  # verified rows on AMX-INT8 tiles: the larger tree
    assert engine.options.ddtree_budget == (AMX_DDTREE_BUDGET if tiles else DEFAULT_DDTREE_BUDGET["cpu"])
    modules = [*engine.target.modules(), *engine.drafter.modules(), *(engine.drafter.draft_head.modules()
                                                                      if engine.drafter.draft_head else [])]
    assert {m.products for m in modules if isinstance(m, QuantizedLinear)} == {"int8"}
    ids, got, want = logits_beside_float32(engine)
    # Observed on this prompt (logits up to about 38): mean |difference| 0.27, max 2.3, 95% of the positions
    # agree on the top token. The inputs' rounding (1/254 of a block's largest value) is what llama.cpp's int8
    # activations do too; the bounds leave margins of about 2x.
    difference = (got - want).abs()
    assert difference.mean().item() < 0.5 and difference.max().item() < 5.0
    assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() > 0.85
    assert_speculation_is_plain(engine, ids, "int8")
