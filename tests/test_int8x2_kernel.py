"""Int8 products with inputs in two 8-bit parts (`--cpu-matmul int8x2`): each block rounded to q and its residual
rounded again to 8 bits, the products exact for those inputs, within a bound about 256 times tighter than one
part's, the same bits for a row alone or in any batch, on tiles or vectors and on the narrower instruction sets; the
default model's logits near the float32 kernel's and its speculative decoding exactly its plain decoding."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from dflash.engine.engine import EngineOptions
from dflash.engine.loading import LoadOptions, load_engine
from dflash.errors import ModelLoadError
from dflash.kernels.build import Int8Kernel, load_int8_kernel
from dflash.models import cpu_matmul
from dflash.models.quantized_layers import QuantizedLinear
from tests.test_int8_kernel import (
    SUM_TOLERANCE,
    assert_speculation_is_plain,
    logits_beside_float32,
    needs_int8,
    reference_quantize,
    weights_of,
)
from tests.test_quantized_kernel import Q4_1, Q8_0, quantized_blocks, raw_blocks, two_threads  # noqa: F401


@pytest.fixture(scope="module")
def kernel() -> Int8Kernel:
    return load_int8_kernel()


def two_part_inputs(x: torch.Tensor) -> torch.Tensor:
    """The inputs the two-part products use, in float64: d q + (d / 256) low, with q and d as for one part and low
    the float32 residual x - d q rounded (half to even) at steps of d / 256, within +-127. [M, K]"""
    q, scales = reference_quantize(x)
    d = scales.numpy()[..., None]  # [M, K / 32, 1] float32
    blocks = x.numpy().reshape(x.shape[0], -1, 32)
    residual = blocks - d * q.numpy().reshape(blocks.shape).astype(np.float32)  # float32, as the kernel
    with np.errstate(divide="ignore"):
        inverse = np.where(d > 0, np.float32(256) / d, np.float32(0)).astype(np.float32)
    low = np.clip(np.rint(residual * inverse), -127, 127)
    values = d.astype(np.float64) * (q.numpy().reshape(blocks.shape) + low / 256.0)
    return torch.from_numpy(values.reshape(x.shape))


def one_part_bound(x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The one-part rounding bound: max|x_b| / 254 per value, times each block's summed |weights|. [M, N]"""
    half_step = x.double().abs().view(x.shape[0], -1, 32).amax(-1) / 254  # [M, K / 32]
    return half_step @ weights.abs().view(weights.shape[0], -1, 32).sum(-1).T


@needs_int8
@pytest.mark.parametrize("qtype", [Q4_1, Q8_0])
@pytest.mark.parametrize(("rows", "columns"), [(1, 32), (37, 96), (53, 1536), (19, 1568)])
def test_products_of_the_two_part_inputs(
    kernel: Int8Kernel, qtype: GGMLQuantizationType, rows: int, columns: int
) -> None:
    for make in (quantized_blocks, raw_blocks):
        blocks = make(rows, columns, qtype, seed=rows + columns)
        weights = weights_of(blocks, qtype)
        generator = torch.Generator().manual_seed(rows)
        for m in (1, 5, 7, 16, 17):
            x = torch.randn(m, columns, generator=generator) * 2
            y = kernel.matmul(x, torch.from_numpy(blocks), int(qtype), True, 2).double()
            exact = two_part_inputs(x) @ weights.T
            assert (y - exact).abs().max().item() <= SUM_TOLERANCE * exact.abs().max().item()
            # the second part's half step is 1/256 of the first's (+ the clamp at 127, which half a step never reaches)
            slack = SUM_TOLERANCE * exact.abs().max().item()
            assert ((y - x.double() @ weights.T).abs() <= one_part_bound(x, weights) / 256 + slack).all()


@needs_int8
@pytest.mark.usefixtures("two_threads")
@pytest.mark.parametrize("qtype", [Q4_1, Q8_0])
def test_every_row_is_bitwise_the_row_alone_on_tiles_or_vectors(kernel: Int8Kernel, qtype: GGMLQuantizationType) -> None:
    blocks = torch.from_numpy(raw_blocks(203, 608, qtype, seed=7))  # 19 blocks, odd N
    x = torch.randn(40, 608, generator=torch.Generator().manual_seed(0)) * 3.0
    alone = torch.cat([kernel.matmul(x[i : i + 1], blocks, int(qtype), True, 2) for i in range(x.shape[0])])
    for m in (2, 5, 6, 9, 16, 17, 40):
        for tiles in (True, False):
            assert torch.equal(kernel.matmul(x[:m], blocks, int(qtype), tiles, 2), alone[:m]), (m, tiles)
    assert not torch.equal(kernel.matmul(x[:6], blocks, int(qtype), True, 1), alone[:6])  # one part differs


@needs_int8
def test_parts_other_than_one_or_two_are_refused(kernel: Int8Kernel) -> None:
    blocks = torch.from_numpy(quantized_blocks(16, 64, Q8_0, seed=0))
    with pytest.raises(RuntimeError, match="one or two 8-bit parts"):
        kernel.matmul(torch.randn(2, 64), blocks, int(Q8_0), True, 3)


@pytest.mark.slow
@pytest.mark.parametrize("flags", [("-mno-avx512f",), ("-mno-avx512f", "-mno-avxvnni")])
def test_two_parts_on_the_256_bit_builds(kernel: Int8Kernel, flags: tuple[str, ...]) -> None:
    """The 256-bit builds' two-part products (their second parts rounded by the scalar loop) are the two-part
    inputs' products, row invariant, and bitwise the default build's (whose second parts may be vector code)."""
    narrow = load_int8_kernel(flags)
    if not narrow.available():
        pytest.skip("no AVX2 here")
    x = torch.randn(19, 224, generator=torch.Generator().manual_seed(2))
    # a block whose scale is 1 and residuals reach half a step both ways (+-128 second-part steps, clamped to 127)
    x[0, :32] = torch.tensor([127.0, 0.5, -0.5, 1.5, -2.5, 0.25, -0.75, 3.0] * 4)
    for qtype in (Q4_1, Q8_0):
        blocks = raw_blocks(45, 224, qtype, seed=5)
        y = narrow.matmul(x, torch.from_numpy(blocks), int(qtype), True, 2)
        exact = two_part_inputs(x) @ weights_of(blocks, qtype).T
        assert (y.double() - exact).abs().max().item() <= SUM_TOLERANCE * exact.abs().max().item()
        alone = torch.cat([narrow.matmul(x[i : i + 1], torch.from_numpy(blocks), int(qtype), True, 2)
                           for i in range(19)])
        assert torch.equal(y, alone)
        assert torch.equal(y, kernel.matmul(x, torch.from_numpy(blocks), int(qtype), True, 2))


def test_choice_of_int8x2(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_matmul, "int8_obstacle", lambda: "no dot products here")
    with pytest.raises(ModelLoadError, match="--cpu-matmul int8x2 is not available: no dot products here"):
        cpu_matmul.choose_cpu_matmul("int8x2")
    monkeypatch.setattr(cpu_matmul, "int8_obstacle", lambda: None)
    assert cpu_matmul.choose_cpu_matmul("int8x2") == cpu_matmul.MatmulChoice("int8x2", "int8x2 products requested")


@needs_int8
def test_default_model_under_two_part_products() -> None:
    engine = load_engine("default", "default", loading=LoadOptions(device="cpu", cpu_matmul="int8x2"))
    assert engine.cpu_matmul == "int8x2" and engine.drafter is not None
    assert {m.products for m in engine.target.modules() if isinstance(m, QuantizedLinear)} == {"int8x2"}
    # the drafter (and its shortlist head) rounds its inputs to one part: drafts are proposals, checked at int8x2
    drafter_matrices = [m for m in engine.drafter.modules() if isinstance(m, QuantizedLinear)]
    assert drafter_matrices and {m.products for m in drafter_matrices} == {"int8"}
    head = engine.drafter.draft_head
    assert head is not None and isinstance(head.rows, QuantizedLinear) and head.rows.products == "int8"
    ids, got, want = logits_beside_float32(engine)
    # Observed on this prompt (40 positions): mean |difference| 0.0013, max 0.012, every top token the same (bf16
    # products on AMX tiles: 0.067 and 0.41, 97.5% the same; one part: 0.23 and 1.8).
    difference = (got - want).abs()
    assert difference.mean().item() < 0.01 and difference.max().item() < 0.1
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert_speculation_is_plain(engine, ids, "int8x2")


@needs_int8
def test_auto_takes_two_parts_where_rows_come_one_per_step() -> None:
    """auto: int8x2 for an engine that decodes one row per step (no drafter, or --spec none); with a drafter, the
    bf16 tiles where the CPU has them (verified rows cost about one there), else int8x2."""
    assert load_engine("default", "none", loading=LoadOptions(device="cpu")).cpu_matmul == "int8x2"
    plain = load_engine("default", "default", options=EngineOptions(spec="none"), loading=LoadOptions(device="cpu"))
    assert plain.cpu_matmul == "int8x2"
    speculating = load_engine("default", "default", loading=LoadOptions(device="cpu"))
    assert speculating.cpu_matmul == ("amx" if cpu_matmul.amx_obstacle() is None else "int8x2")
