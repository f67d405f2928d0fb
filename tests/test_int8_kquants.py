"""The int8 kernel on the formats people download besides Q4_1 / Q8_0: Q4_0 and the K formats (Q4_K, Q5_K, Q6_K).

For one- and two-part inputs: the products equal those of the rounded inputs with `gguf`'s dequantised weights (up
to float32 summation order), and the float products within the inputs' rounding bound; every row is bitwise the
row alone, on vectors and on AMX-INT8 tiles (Q6_K stays on vectors); the 256-bit builds give the 512-bit build's
bits; rows of the wrong length are refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from dflash.kernels.build import Int8Kernel, load_int8_kernel
from tests.test_int8_kernel import SUM_TOLERANCE, dequantized_inputs, needs_int8, rounding_bound, weights_of
from tests.test_int8x2_kernel import two_part_inputs
from tests.test_quantized_kernel import two_threads  # noqa: F401

T = GGMLQuantizationType
FORMATS = [T.Q4_0, T.Q4_K, T.Q5_K, T.Q6_K]
ROW_COUNTS = (1, 3, 7, 16)  # one row, vector tiles of 3 (4 + 3), tiles of AMX-INT8 where the CPU has them
# Where each format's fp16 scales sit in a block: (offset, count) of d (and dmin)
SCALE_FIELDS = {T.Q4_0: (0, 1), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208, 1)}
BLOCK = {T.Q4_0: (32, 18), T.Q4_K: (256, 144), T.Q5_K: (256, 176), T.Q6_K: (256, 210)}


@pytest.fixture(scope="module")
def kernel() -> Int8Kernel:
    return load_int8_kernel()


def raw_blocks(rows: int, columns: int, qtype: GGMLQuantizationType, seed: int) -> np.ndarray:
    """[rows, bytes per row]: arbitrary bytes (every value, 6-bit scale and min, int8 scale including -128) with
    finite fp16 scales of both signs, the first one subnormal."""
    rng = np.random.default_rng(seed)
    values, size = BLOCK[qtype]
    blocks = rng.integers(0, 256, (rows * columns // values, size), dtype=np.uint8)
    at, count = SCALE_FIELDS[qtype]
    spread = 0.05 if qtype == T.Q4_0 else 2e-3  # the K formats multiply d by scales up to 63 (or 128)
    scales = rng.uniform(-spread, spread, (blocks.shape[0], count)).astype(np.float16)
    scales[0, 0] = np.float16(3e-6)
    blocks[:, at : at + 2 * count] = scales.view(np.uint8)
    return blocks.reshape(rows, -1)


def quantized_q4_0(rows: int, columns: int, seed: int) -> np.ndarray:
    """Q4_0 blocks quantised from Gaussian weights by `gguf` (the K formats it cannot quantise)."""
    rng = np.random.default_rng(seed)
    weights = rng.standard_normal((rows, columns)).astype(np.float32) * rng.uniform(0.01, 0.2, (rows, 1))
    return np.ascontiguousarray(quantize(weights.astype(np.float32), T.Q4_0))


def block_sets(qtype: GGMLQuantizationType, rows: int, columns: int, seed: int) -> list[np.ndarray]:
    made = [raw_blocks(rows, columns, qtype, seed)]
    if qtype == T.Q4_0:
        made.append(quantized_q4_0(rows, columns, seed))
    return made


def columns_of(qtype: GGMLQuantizationType) -> list[int]:
    """Reductions that are not multiples of 256 (Q4_0: 3, 18 and 49 blocks: odd counts end on a half-empty pair)
    and that are (one super-block, two, six)."""
    return [96, 576, 1568, 1536] if qtype == T.Q4_0 else [256, 512, 1536]


def assert_products(y: torch.Tensor, x: torch.Tensor, rounded: torch.Tensor, weights: torch.Tensor, bound: torch.Tensor
                    ) -> None:
    """y equals rounded @ W^T up to float32 summation order, and x @ W^T within `bound` (+ that slack)."""
    exact = rounded @ weights.T  # [M, N]
    slack = SUM_TOLERANCE * (rounded.abs() @ weights.abs().T).max().item()  # the terms' magnitude: min terms cancel
    assert (y.double() - exact).abs().max().item() <= slack
    assert ((y.double() - x.double() @ weights.T).abs() <= bound + slack).all()


@needs_int8
@pytest.mark.parametrize("qtype", FORMATS, ids=lambda qtype: qtype.name)
def test_one_part_products(kernel: Int8Kernel, qtype: GGMLQuantizationType) -> None:
    for columns in columns_of(qtype):
        for blocks in block_sets(qtype, 37, columns, seed=columns):
            weights = weights_of(blocks, qtype)
            generator = torch.Generator().manual_seed(columns)
            for m in ROW_COUNTS:
                x = torch.randn(m, columns, generator=generator) * 2
                y = kernel.matmul(x, torch.from_numpy(blocks), int(qtype))
                assert y.shape == (m, 37) and y.dtype == torch.float32
                q, scales = kernel.quantize(x)
                assert_products(y, x, dequantized_inputs(q, scales), weights, rounding_bound(x, weights))


@needs_int8
@pytest.mark.parametrize("qtype", FORMATS, ids=lambda qtype: qtype.name)
def test_two_part_products(kernel: Int8Kernel, qtype: GGMLQuantizationType) -> None:
    """The second part's half step is 1/256 of the first's: the bound shrinks 256 times."""
    for columns in columns_of(qtype):
        for blocks in block_sets(qtype, 37, columns, seed=columns + 1):
            weights = weights_of(blocks, qtype)
            generator = torch.Generator().manual_seed(columns + 1)
            for m in ROW_COUNTS:
                x = torch.randn(m, columns, generator=generator) * 2
                y = kernel.matmul(x, torch.from_numpy(blocks), int(qtype), True, 2)
                assert_products(y, x, two_part_inputs(x), weights, rounding_bound(x, weights) / 256)


@needs_int8
@pytest.mark.usefixtures("two_threads")
@pytest.mark.parametrize("qtype", FORMATS, ids=lambda qtype: qtype.name)
@pytest.mark.parametrize("parts", [1, 2])
def test_every_row_is_bitwise_the_row_alone(kernel: Int8Kernel, qtype: GGMLQuantizationType, parts: int) -> None:
    """Row i of an M-row product equals row i alone, on tiles (6+ rows, where the CPU has AMX-INT8; Q6_K stays on
    vectors) and on vectors, on two threads and one."""
    columns = 1568 if qtype == T.Q4_0 else 512
    blocks = torch.from_numpy(raw_blocks(203, columns, qtype, seed=7))  # odd N: tail rows of every group
    x = torch.randn(40, columns, generator=torch.Generator().manual_seed(0)) * 3.0
    alone = torch.cat([kernel.matmul(x[i : i + 1], blocks, int(qtype), True, parts) for i in range(x.shape[0])])
    for m in (2, 3, 5, 6, 7, 9, 16, 17, 40):
        for tiles in (True, False):
            assert torch.equal(kernel.matmul(x[:m], blocks, int(qtype), tiles, parts), alone[:m]), (m, tiles)
    assert torch.equal(kernel.matmul(x[5:22], blocks, int(qtype), True, parts), alone[5:22])
    torch.set_num_threads(1)
    assert torch.equal(kernel.matmul(x[:17], blocks, int(qtype), True, parts), alone[:17])


@needs_int8
def test_rows_that_are_not_whole_super_blocks_are_refused(kernel: Int8Kernel) -> None:
    blocks = torch.from_numpy(raw_blocks(4, 256, T.Q4_K, seed=0))
    with pytest.raises(RuntimeError, match="not a multiple of 256"):
        kernel.matmul(torch.randn(2, 288), torch.zeros(4, 162, dtype=torch.uint8), int(T.Q4_K))
    with pytest.raises(RuntimeError, match="bytes per row"):
        kernel.matmul(torch.randn(2, 512), blocks, int(T.Q4_K))
    with pytest.raises(RuntimeError, match="bytes per row"):
        kernel.matmul(torch.randn(2, 256), blocks, int(T.Q6_K))


@pytest.mark.slow
@pytest.mark.parametrize("flags", [("-mno-avx512f",), ("-mno-avx512f", "-mno-avxvnni")])
def test_the_256_bit_builds_give_the_same_bits(flags: tuple[str, ...]) -> None:
    """AVX-VNNI and AVX2's maddubs (8 weight rows a step, one block at a time, the scales gathered alike) run the
    same chain as the 512-bit build, and every path the same bits: products of the rounded inputs, row alone ==
    row in a batch, and (where this CPU has the 512-bit build) that build's values exactly."""
    narrow = load_int8_kernel(flags)
    if not narrow.available():
        pytest.skip("no AVX2 here")
    wide = load_int8_kernel()
    x = torch.randn(19, 512, generator=torch.Generator().manual_seed(2))
    for qtype in FORMATS:
        blocks = raw_blocks(45, 512, qtype, seed=5)
        weights = weights_of(blocks, qtype)
        for parts in (1, 2):
            y = narrow.matmul(x, torch.from_numpy(blocks), int(qtype), True, parts)
            if parts == 1:
                q, scales = narrow.quantize(x)
                rounded = dequantized_inputs(q, scales)
            else:
                rounded = two_part_inputs(x)
            exact = rounded @ weights.T
            assert (y.double() - exact).abs().max().item() <= SUM_TOLERANCE * (rounded.abs() @ weights.abs().T).max()
            alone = torch.cat([narrow.matmul(x[i : i + 1], torch.from_numpy(blocks), int(qtype), True, parts)
                               for i in range(19)])
            assert torch.equal(y, alone)
            if wide.isa() == "avx512-vnni":
                assert torch.equal(y, wide.matmul(x, torch.from_numpy(blocks), int(qtype), True, parts)), qtype
