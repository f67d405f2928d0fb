"""The Q4_1 / Q8_0 matmul kernel against `gguf`'s reference dequantisation: values, batch invariance, errors."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from dflash.kernels.build import QuantKernel, load_quant_kernel
from dflash.models.gguf_file import GGUFFile
from tests.loading_helpers import smollm2_path

Q4_1, Q8_0 = GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0
BLOCK_BYTES = {Q4_1: 20, Q8_0: 34}
# Relative to max |y|: summation order differs from the float64 reference, nothing else does.
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def kernel() -> QuantKernel:
    return load_quant_kernel()


@pytest.fixture()
def two_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def quantized_blocks(rows: int, columns: int, qtype: GGMLQuantizationType, seed: int) -> np.ndarray:
    """Blocks quantised from Gaussian weights with a per-row scale spread, as a real matrix would be."""
    rng = np.random.default_rng(seed)
    weights = rng.standard_normal((rows, columns)).astype(np.float32) * rng.uniform(0.01, 0.2, (rows, 1))
    return np.ascontiguousarray(quantize(weights.astype(np.float32), qtype))


def raw_blocks(rows: int, columns: int, qtype: GGMLQuantizationType, seed: int) -> np.ndarray:
    """Arbitrary block bytes (every nibble / int8 value, both signs of d and m) with finite fp16 scales."""
    rng = np.random.default_rng(seed)
    n_blocks = columns // 32
    blocks = rng.integers(0, 256, (rows, n_blocks, BLOCK_BYTES[qtype]), dtype=np.uint8)
    scales = rng.uniform(-0.05, 0.05, (rows, n_blocks, 2)).astype(np.float16)
    scales[0, 0, 0] = np.float16(3e-6)  # a subnormal fp16 scale
    n_scales = 2 if qtype == Q4_1 else 1
    blocks[..., : 2 * n_scales] = scales[..., :n_scales].view(np.uint8).reshape(rows, n_blocks, 2 * n_scales)
    return blocks.reshape(rows, -1)


def reference_product(x: torch.Tensor, blocks: np.ndarray, qtype: GGMLQuantizationType) -> torch.Tensor:
    weights = torch.from_numpy(dequantize(blocks, qtype)).double()  # [N, K]
    return x.double() @ weights.T


def assert_close_to_reference(y: torch.Tensor, reference: torch.Tensor) -> None:
    scale = reference.abs().max().item()
    error = (y.double() - reference).abs().max().item()
    assert error <= TOLERANCE * scale, f"max error {error:.3g} vs max |y| {scale:.3g}"


@pytest.mark.parametrize("qtype", [Q4_1, Q8_0])
@pytest.mark.parametrize("make", [quantized_blocks, raw_blocks])
def test_dequantize_is_bitwise_the_reference(kernel: QuantKernel, qtype: GGMLQuantizationType, make) -> None:  # type: ignore[no-untyped-def]
    blocks = make(37, 160, qtype, seed=1)
    ours = kernel.dequantize(torch.from_numpy(blocks), int(qtype), 160)
    assert torch.equal(ours, torch.from_numpy(dequantize(blocks, qtype)))


@pytest.mark.parametrize("qtype", [Q4_1, Q8_0])
@pytest.mark.parametrize(("rows", "columns"), [(1, 32), (37, 96), (101, 576), (53, 1536)])
def test_matmul_matches_the_dequantised_product(
    kernel: QuantKernel, qtype: GGMLQuantizationType, rows: int, columns: int
) -> None:
    for make in (quantized_blocks, raw_blocks):
        blocks = make(rows, columns, qtype, seed=rows + columns)
        generator = torch.Generator().manual_seed(rows)
        for m in (1, 2, 3, 5, 7, 16, 17, 33, 64, 130):
            x = torch.randn(m, columns, generator=generator)
            y = kernel.matmul(x, torch.from_numpy(blocks), int(qtype))
            assert y.shape == (m, rows) and y.dtype == torch.float32
            assert_close_to_reference(y, reference_product(x, blocks, qtype))


@pytest.mark.parametrize("qtype", [Q4_1, Q8_0])
def test_rows_are_bitwise_independent_of_the_batch(
    kernel: QuantKernel, qtype: GGMLQuantizationType, two_threads: None
) -> None:
    """Row i of an M-row product equals the product of row i alone, for every M the engine uses."""
    blocks = torch.from_numpy(quantized_blocks(203, 576, qtype, seed=7))  # odd N: tail rows of every tile
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(300, 576, generator=generator) * 3.0
    alone = torch.cat([kernel.matmul(x[i : i + 1], blocks, int(qtype)) for i in range(x.shape[0])])
    for m in (2, 3, 4, 5, 6, 7, 8, 13, 16, 17, 33, 64, 65, 256, 300):
        batch = kernel.matmul(x[:m], blocks, int(qtype))
        assert torch.equal(batch, alone[:m]), f"M={m}"
    window = kernel.matmul(x[5:22], blocks, int(qtype))  # a verification-sized window from the middle
    assert torch.equal(window, alone[5:22])


def test_results_do_not_depend_on_the_thread_count(kernel: QuantKernel) -> None:
    blocks = torch.from_numpy(quantized_blocks(331, 576, Q4_1, seed=3))
    x = torch.randn(17, 576, generator=torch.Generator().manual_seed(1))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = kernel.matmul(x, blocks, int(Q4_1))
        torch.set_num_threads(2)
        double = kernel.matmul(x, blocks, int(Q4_1))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(single, double)


def test_non_contiguous_input_is_accepted(kernel: QuantKernel) -> None:
    blocks = quantized_blocks(40, 64, Q8_0, seed=2)
    x = torch.randn(64, 9).T  # [9, 64], column-major
    y = kernel.matmul(x, torch.from_numpy(blocks), int(Q8_0))
    assert torch.equal(y, kernel.matmul(x.contiguous(), torch.from_numpy(blocks), int(Q8_0)))
    assert_close_to_reference(y, reference_product(x, blocks, Q8_0))


def check_refusals(kernel: Any) -> None:
    """What the tiled kernels (AMX, int8) refuse with a clear error: rows of the wrong length, an unknown block
    format, float64 inputs."""
    blocks = torch.from_numpy(quantized_blocks(16, 64, Q8_0, seed=0))
    with pytest.raises(RuntimeError, match="bytes per row"):
        kernel.matmul(torch.randn(2, 96), blocks, int(Q8_0))
    with pytest.raises(RuntimeError, match="unsupported quantisation type"):
        kernel.matmul(torch.randn(2, 64), blocks, int(GGMLQuantizationType.Q2_K))
    with pytest.raises(RuntimeError, match="float32"):
        kernel.matmul(torch.randn(2, 64, dtype=torch.float64), blocks, int(Q8_0))


def test_bad_arguments_are_refused(kernel: QuantKernel) -> None:
    blocks = torch.from_numpy(quantized_blocks(8, 64, Q4_1, seed=0))
    with pytest.raises(RuntimeError, match="bytes per row"):
        kernel.matmul(torch.randn(2, 96), blocks, int(Q4_1))
    with pytest.raises(RuntimeError, match="unsupported quantisation type"):
        kernel.matmul(torch.randn(2, 64), blocks, int(GGMLQuantizationType.Q4_0))
    with pytest.raises(RuntimeError, match="float32"):
        kernel.matmul(torch.randn(2, 64, dtype=torch.float64), blocks, int(Q4_1))
    with pytest.raises(RuntimeError, match="uint8"):
        kernel.matmul(torch.randn(2, 64), blocks.to(torch.int16), int(Q4_1))
    assert kernel.matmul(torch.randn(0, 64), blocks, int(Q4_1)).shape == (0, 8)


@pytest.mark.parametrize("name", ["blk.0.attn_q.weight", "blk.7.ffn_down.weight", "blk.29.ffn_gate.weight", "token_embd.weight"])
def test_real_smollm2_matrices(kernel: QuantKernel, name: str) -> None:
    """The packaged model's own blocks (Q4_1 projections, Q8_0 embedding) against `gguf`'s dequantisation."""
    gguf = GGUFFile(smollm2_path())
    info = gguf.tensors[name]
    blocks = np.array(gguf.raw(info), dtype=np.uint8)
    if name == "token_embd.weight":
        blocks = np.ascontiguousarray(blocks[::7])  # every 7th token row: 7022 rows
    rows, columns = blocks.shape[0], info.shape[1]
    x = torch.randn(17, columns, generator=torch.Generator().manual_seed(0))
    y = kernel.matmul(x, torch.from_numpy(blocks), int(info.qtype))
    assert y.shape == (17, rows)
    assert_close_to_reference(y, reference_product(x, blocks, info.qtype))
    assert torch.equal(y[3], kernel.matmul(x[3:4], torch.from_numpy(blocks), int(info.qtype))[0])


@pytest.mark.slow
@pytest.mark.parametrize(
    ("flags", "isa"), [(("-mno-avx512f",), "avx2"), (("-mno-avx512f", "-mno-avx2", "-mno-fma", "-mno-f16c"), "generic")]
)
def test_narrower_instruction_sets(flags: tuple[str, ...], isa: str) -> None:
    """The AVX2 and portable builds (chosen at compile time) give the same values and the same invariance."""
    narrow = load_quant_kernel(flags)
    assert narrow.isa() == isa
    for qtype in (Q4_1, Q8_0):
        blocks = raw_blocks(45, 192, qtype, seed=5)
        assert torch.equal(narrow.dequantize(torch.from_numpy(blocks), int(qtype), 192),
                           torch.from_numpy(dequantize(blocks, qtype)))
        x = torch.randn(19, 192, generator=torch.Generator().manual_seed(2))
        y = narrow.matmul(x, torch.from_numpy(blocks), int(qtype))
        assert_close_to_reference(y, reference_product(x, blocks, qtype))
        alone = torch.cat([narrow.matmul(x[i : i + 1], torch.from_numpy(blocks), int(qtype)) for i in range(19)])
        assert torch.equal(y, alone)
