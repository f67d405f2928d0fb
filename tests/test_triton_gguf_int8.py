"""4-bit GGUF matrices as words (`dflash.kernels.gguf_nibbles`) and their integer-dot products
(`dflash.kernels.triton_gguf_int8`): the re-laid weights are exactly the file's, the products match float products
with the dequantised weights, and a row's result does not depend on the rows beside it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from dflash import environment
from dflash.kernels import gguf_nibbles, triton_gguf_int8
from dflash.kernels.gguf_nibbles import NIBBLE_FORMATS, nibble_matrix
from dflash.kernels.triton_decode import add_rms_norm, silu_and_mul
from dflash.kernels.triton_gguf_int8 import (
    MAX_ROWS,
    NibbleConfig,
    QuantizedInput,
    add_rms_norm_quantized,
    input_parts,
    integer_rows,
    nibble_dequantize,
    nibble_dot,
    nibble_matmul,
    nibble_product,
    quantize_input,
    silu_and_mul_quantized,
)
from tests.test_triton_gguf_matmul import DEVICE, format_blocks, needs_triton

T = GGMLQuantizationType


def reduction(qtype: GGMLQuantizationType) -> int:
    return 288 if qtype in (T.Q4_0, T.Q4_1) else 768  # 9 groups; 3 super-blocks (24 groups)


@pytest.mark.parametrize("qtype", NIBBLE_FORMATS, ids=lambda t: t.name)
def test_words_and_scales_are_the_files_weights(qtype: GGMLQuantizationType) -> None:
    k = reduction(qtype)
    blocks = format_blocks(24, k, qtype, seed=3)
    matrix = nibble_matrix(torch.from_numpy(blocks), qtype, k)
    assert matrix.words.shape == (24, k // 8) and matrix.words.dtype == torch.int32
    expected = torch.from_numpy(dequantize(blocks, qtype).reshape(24, k)).float()
    assert torch.equal(matrix.dequantized(), expected)  # bit for bit: fp16 scales times small integers in float32
    assert matrix.nbytes == (blocks.size if qtype != T.Q4_K else blocks.size + 24 * (k // 256) * 4)


@pytest.mark.parametrize("qtype", NIBBLE_FORMATS, ids=lambda t: t.name)
def test_rows_re_laid_a_few_at_a_time_equal_one_pass(qtype: GGMLQuantizationType, monkeypatch: pytest.MonkeyPatch) -> None:
    """A big matrix is re-laid in passes of rows (bounded temporaries): 24 rows 5 at a time, the last pass short."""
    k = reduction(qtype)
    blocks = torch.from_numpy(format_blocks(24, k, qtype, seed=5))
    whole = nibble_matrix(blocks, qtype, k)
    monkeypatch.setattr(gguf_nibbles, "_VALUES_PER_PASS", 5 * k)
    passes = nibble_matrix(blocks, qtype, k)
    for name in ("words", "pairs", "sub_scales", "high_bits"):
        a, b = getattr(whole, name), getattr(passes, name)
        assert (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b)), name


@needs_triton
def test_input_parts_rebuild_the_input() -> None:
    generator = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 96, generator=generator) * torch.tensor([0.01, 1.0, 30.0])[:, None]).to(DEVICE)
    x[1, 32:64] = 0.0  # a zero group: scale 0, parts 0
    parts = quantize_input(x)
    rebuilt = (parts.high.float() * 256 + parts.low.float()).view(3, 3, 32) * parts.scale[..., None]
    error = (rebuilt.view(3, 96) - x).abs().max(dim=1).values
    assert bool((error <= x.abs().max(dim=1).values / (127 * 256)).all())  # about 15 bits
    assert bool((parts.high.abs() <= 127).all()) and bool((parts.low.abs() <= 127).all())
    sums = (parts.high.float() * 256 + parts.low.float()).view(3, 3, 32).sum(-1) * parts.scale
    torch.testing.assert_close(parts.total, sums, rtol=1e-6, atol=0.0)
    assert float(parts.scale[1, 1]) == 0.0 and float(parts.total[1, 1]) == 0.0


@needs_triton
@pytest.mark.parametrize("qtype", NIBBLE_FORMATS, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 3, MAX_ROWS])
def test_products_match_the_dequantised_weights(qtype: GGMLQuantizationType, rows: int) -> None:
    k, n = reduction(qtype), 37  # outputs that fill no tile
    blocks = format_blocks(n, k, qtype, seed=rows)
    matrix = nibble_matrix(torch.from_numpy(blocks), qtype, k).to(DEVICE)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(DEVICE)
    weights = matrix.dequantized()
    want = x @ weights.T
    got = nibble_matmul(x, matrix, NibbleConfig(block_n=4, group_step=8))
    assert got.dtype == x.dtype and got.shape == (rows, n)
    scale = (x.abs() @ weights.abs().T).max()  # the inputs' rounding is ~2^-15 of each product
    assert float((got - want).abs().max()) <= float(scale) * 2e-4


@needs_triton
@pytest.mark.parametrize("qtype", NIBBLE_FORMATS, ids=lambda t: t.name)
def test_a_rows_result_does_not_depend_on_its_neighbours(qtype: GGMLQuantizationType) -> None:
    k, n = reduction(qtype), 20
    matrix = nibble_matrix(torch.from_numpy(format_blocks(n, k, qtype, seed=9)), qtype, k).to(DEVICE)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    config = NibbleConfig(block_n=8, group_step=4)  # configurations are chosen by the matrix, never by the rows
    together = nibble_matmul(x, matrix, config)
    for row in range(5):
        alone = nibble_matmul(x[row : row + 1].contiguous(), matrix, config)
        assert torch.equal(alone[0], together[row]), row


@needs_triton
def test_one_part_input_is_the_rounding_to_eight_bits() -> None:
    generator = torch.Generator().manual_seed(1)
    x = (torch.randn(3, 96, generator=generator) * torch.tensor([0.01, 1.0, 30.0])[:, None]).to(DEVICE)
    x[2, :32] = 0.0
    parts = quantize_input(x, parts=1)
    assert parts.parts == 1 and bool((parts.high.abs() <= 127).all())
    rebuilt = parts.high.float().view(3, 3, 32) * parts.scale[..., None]
    group_max = x.view(3, 3, 32).abs().amax(-1, keepdim=True)
    assert bool(((rebuilt - x.view(3, 3, 32)).abs() <= group_max / 254 * (1 + 1e-5)).all())  # half a step of 127
    torch.testing.assert_close(parts.total, parts.high.float().view(3, 3, 32).sum(-1) * parts.scale, rtol=1e-6, atol=0.0)
    halves = parts.high.float().view(3, 6, 16).sum(-1) * parts.scale.repeat_interleave(2, dim=1)
    torch.testing.assert_close(parts.half_total, halves, rtol=1e-6, atol=0.0)
    assert float(parts.scale[2, 0]) == 0.0
    with pytest.raises(ValueError, match="one or two"):
        quantize_input(x, parts=3)


@needs_triton
@pytest.mark.parametrize("qtype", NIBBLE_FORMATS, ids=lambda t: t.name)
def test_one_part_products_are_exact_for_the_rounded_input(qtype: GGMLQuantizationType) -> None:
    """Integer sums are exact, so with one part the product is the float product of the rounded input (dx high)
    and the weights, up to float32 sums; and a row's result still does not depend on the rows beside it."""
    k, n = reduction(qtype), 19
    matrix = nibble_matrix(torch.from_numpy(format_blocks(n, k, qtype, seed=6)), qtype, k).to(DEVICE)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    parts = quantize_input(x, parts=1)
    rounded = (parts.high.float().view(3, k // 32, 32) * parts.scale[..., None]).view(3, k)
    weights = matrix.dequantized()
    want = rounded.double() @ weights.double().T
    config = NibbleConfig(block_n=4, group_step=8)
    got = nibble_matmul(parts, matrix, config, dtype=torch.float32)
    scale = (rounded.abs() @ weights.abs().T).max()
    assert float((got.double() - want).abs().max()) <= float(scale) * 1e-6
    assert float((got - x @ weights.T).abs().max()) > float(scale) * 1e-4  # coarser than two parts: really one
    for row in range(3):
        alone = nibble_matmul(quantize_input(x[row : row + 1].contiguous(), parts=1), matrix, config, dtype=torch.float32)
        assert torch.equal(alone[0], got[row]), row


@needs_triton
@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_64_bit_offsets_give_the_same_products(qtype: GGMLQuantizationType, monkeypatch: pytest.MonkeyPatch) -> None:
    """The programs take 32-bit offsets below `WIDE_WORDS` words; the 64-bit variant (huge matrices) agrees."""
    k, n = reduction(qtype), 13
    matrix = nibble_matrix(torch.from_numpy(format_blocks(n, k, qtype, seed=8)), qtype, k).to(DEVICE)
    x = torch.randn(2, k, generator=torch.Generator().manual_seed(8)).to(DEVICE)
    narrow = nibble_matmul(x, matrix, NibbleConfig(block_n=4, group_step=8))
    monkeypatch.setattr(triton_gguf_int8, "WIDE_WORDS", 0)
    assert torch.equal(nibble_matmul(x, matrix, NibbleConfig(block_n=4, group_step=8)), narrow)


def test_input_parts_follow_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(environment.GGUF_INPUT, raising=False)
    assert input_parts() == 2
    monkeypatch.setenv(environment.GGUF_INPUT, "int8")
    assert input_parts() == 1
    monkeypatch.setenv(environment.GGUF_INPUT, "int4")
    with pytest.raises(ValueError):
        input_parts()


@needs_triton
def test_refuses_what_it_does_not_serve() -> None:
    matrix = nibble_matrix(torch.from_numpy(format_blocks(4, 64, T.Q4_0, seed=1)), T.Q4_0, 64).to(DEVICE)
    with pytest.raises(ValueError, match="serves 1 to"):
        nibble_matmul(torch.zeros(MAX_ROWS + 1, 64, device=DEVICE), matrix)
    with pytest.raises(ValueError, match="rows of 96 values"):
        nibble_matmul(torch.zeros(1, 96, device=DEVICE), matrix)
    with pytest.raises(ValueError, match="not a 4-bit format"):
        nibble_matrix(torch.zeros(4, 68, dtype=torch.uint8), T.Q8_0, 64)


def test_q4_k_reorder_follows_the_sub_block_pairs() -> None:
    """One Q4_K super-block with every nibble distinct per position: group 2c + h takes the h-th nibbles of chunk
    c's 32 bytes, in byte order."""
    raw = np.zeros((1, 144), dtype=np.uint8)
    raw[0, 0:2] = np.array([1.0], dtype="<f2").view(np.uint8)  # d = 1, dmin = 0
    raw[0, 4:8] = 1  # sub-block scales 1 for j < 4
    raw[0, 12:16] = 1  # and for j >= 4 (low nibbles of the mixed bytes)
    chunk_bytes = (np.arange(128) % 16) | ((15 - np.arange(128) % 16) << 4)
    raw[0, 16:] = chunk_bytes.astype(np.uint8)
    matrix = nibble_matrix(torch.from_numpy(raw), T.Q4_K, 256)
    values = matrix.dequantized().view(8, 32)
    for group in range(8):
        expected = torch.arange(32) % 16 if group % 2 == 0 else 15 - torch.arange(32) % 16
        assert torch.equal(values[group], expected.float()), group
    assert torch.equal(matrix.dequantized()[0], torch.from_numpy(dequantize(raw, T.Q4_K).reshape(256)).float())


@needs_triton
@pytest.mark.parametrize("qtype", NIBBLE_FORMATS, ids=lambda t: t.name)
def test_dequantize_program_gives_the_weights(qtype: GGMLQuantizationType) -> None:
    k = reduction(qtype)
    matrix = nibble_matrix(torch.from_numpy(format_blocks(21, k, qtype, seed=4)), qtype, k).to(DEVICE)
    assert torch.equal(nibble_dequantize(matrix, torch.float32), matrix.dequantized())


@needs_triton
@pytest.mark.parametrize("qtype", NIBBLE_FORMATS, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [5, 16, 40])
@pytest.mark.parametrize("splits", [1, 3])
def test_tensor_core_products_match_the_dequantised_weights(
    qtype: GGMLQuantizationType, rows: int, splits: int
) -> None:
    """Whole reductions, and reductions split in three parts (each a whole number of steps, the last one short
    where the groups do not divide: Q4_0's 9 groups as 4 + 4 + 1), summed in order."""
    k, n = reduction(qtype), 45
    matrix = nibble_matrix(torch.from_numpy(format_blocks(n, k, qtype, seed=rows)), qtype, k).to(DEVICE)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(DEVICE)
    want = x @ matrix.dequantized().T
    got = nibble_dot(x, matrix, block_n=16, group_step=4, splits=splits)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))


def test_split_reductions_keep_every_sm_busy() -> None:
    from dflash.kernels.triton_gguf_int8 import dot_splits

    cpu = torch.device("cpu")  # counted as an H100's 132 SMs
    assert dot_splits(80, 160, cpu) == 7  # a 5,120-row matrix in blocks of 64: 560 programs
    assert dot_splits(544, 40, cpu) == 1  # already 544 programs
    assert dot_splits(3, 6, cpu) == 1  # too short to split


@needs_triton
def test_product_takes_the_path_for_its_rows() -> None:
    """Integer dot products up to `integer_rows()` rows (the inputs' rounding shows), tensor cores beyond (float32
    under the interpreter: the float product's bits up to summation order), each into a slice of a wider output."""
    k, n = 256, 24
    matrix = nibble_matrix(torch.from_numpy(format_blocks(n, k, T.Q4_K, seed=2)), T.Q4_K, k).to(DEVICE)
    weights = matrix.dequantized()
    limit = integer_rows(DEVICE)
    for rows in (limit, limit + 1, 70):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(DEVICE)
        wide = torch.zeros(rows, n + 8, device=DEVICE)
        nibble_product(x, matrix, wide[:, 4 : 4 + n])
        want = x @ weights.T
        tolerance = 2e-4 if rows <= limit else 1e-5
        assert float((wide[:, 4 : 4 + n] - want).abs().max()) <= tolerance * float((x.abs() @ weights.abs().T).max())
        assert not bool(wide[:, :4].any()) and not bool(wide[:, 4 + n :].any())


def assert_same_rounding(got: QuantizedInput, want: QuantizedInput) -> None:
    assert got.parts == want.parts
    names = ("high", "low", "scale", "total", "half_total") if want.parts == 2 else ("high", "scale", "total", "half_total")
    for name in names:
        assert torch.equal(getattr(got, name), getattr(want, name)), name


@needs_triton
@pytest.mark.parametrize("parts", [1, 2])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("adds_one", [False, True])
@pytest.mark.parametrize("width", [288, 512])  # 9 groups (a partly filled tile of 16), 16 groups
def test_norm_rounded_in_its_program_is_the_separate_programs(parts: int, residual: bool, adds_one: bool, width: int) -> None:
    """The fused add+RMSNorm with rounding: its normed rows and sum are bitwise the plain program's, and its
    rounding is bitwise `quantize_input` of those rows."""
    generator = torch.Generator().manual_seed(width + parts)
    dtype = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
    x = (torch.randn(3, width, generator=generator) * torch.tensor([0.05, 1.0, 20.0])[:, None]).to(DEVICE, dtype)
    added = torch.randn(3, width, generator=generator).to(DEVICE, dtype) if residual else None
    weight = torch.randn(width, generator=generator).to(DEVICE, dtype)
    normed, summed, rounded = add_rms_norm_quantized(x, added, weight, 1e-6, adds_one=adds_one, parts=parts)
    want_normed, want_summed = add_rms_norm(x, added, weight, 1e-6, adds_one=adds_one)
    assert torch.equal(normed, want_normed) and torch.equal(summed, want_summed)
    assert_same_rounding(rounded, quantize_input(want_normed, parts=parts))


@needs_triton
@pytest.mark.parametrize("parts", [1, 2])
@pytest.mark.parametrize("inner", [96, 1056])  # one program a row; two, the second with one group
def test_silu_rounded_in_its_programs_is_the_separate_programs(parts: int, inner: int) -> None:
    generator = torch.Generator().manual_seed(inner + parts)
    dtype = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
    gate_up = (torch.randn(2, 2 * inner, generator=generator) * 3.0).to(DEVICE, dtype)
    activated, rounded = silu_and_mul_quantized(gate_up, parts=parts)
    want = silu_and_mul(gate_up)
    assert torch.equal(activated, want)
    assert_same_rounding(rounded, quantize_input(want, parts=parts))
