"""The CUDA products of 1-8 rows with GGUF words (`kernels/cuda_nibble_rows.cu`), on a GPU: against the
dequantised weights (the inputs' rounding bound) and the Triton program, one and two input parts, every word
format, batch invariance (a row's result is the same alone and among 8), bf16 / fp16 / float32 outputs, and
`DFLASH_GGUF_ROWS=triton` taking the Triton program."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType

from dflash.kernels import triton_gguf_int8
from dflash.kernels.gguf_nibbles import NIBBLE_FORMATS, nibble_matrix
from dflash.kernels.triton_gguf_int8 import nibble_matmul, quantize_input
from tests.test_triton_gguf_matmul import format_blocks

pytestmark = pytest.mark.gpu

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CUDA = torch.device("cuda")


def _matrix(qtype: GGMLQuantizationType, n: int, k: int, seed: int) -> triton_gguf_int8.NibbleMatrix:
    return nibble_matrix(torch.from_numpy(format_blocks(n, k, qtype, seed=seed)), qtype, k).to(CUDA)


@needs_cuda
def test_the_program_builds() -> None:
    assert triton_gguf_int8._cuda_rows_kernel() is not None


@needs_cuda
@pytest.mark.parametrize("qtype", NIBBLE_FORMATS, ids=lambda t: t.name)
@pytest.mark.parametrize("parts", [1, 2])
def test_products_match_the_weights_and_the_triton_program(
    qtype: GGMLQuantizationType, parts: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    k, n = 2048 + 256, 999  # 72 groups (a partial unrolled step), an odd number of outputs
    matrix = _matrix(qtype, n, k, seed=parts)
    weights = matrix.dequantized()
    for rows in (1, 3, 8):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(CUDA)
        quantized = quantize_input(x, parts=parts)
        got = nibble_matmul(quantized, matrix, dtype=torch.float32)
        monkeypatch.setenv("DFLASH_GGUF_ROWS", "triton")
        triton = nibble_matmul(quantized, matrix, dtype=torch.float32)
        monkeypatch.delenv("DFLASH_GGUF_ROWS")
        want = x @ weights.T
        scale = float((x.abs() @ weights.abs().T).max())
        bound = 2e-4 if parts == 2 else 2e-2  # one part: llama.cpp's 8-bit rounding
        assert float((got - want).abs().max()) <= scale * bound, rows
        assert float((got - triton).abs().max()) <= scale * 1e-5, rows  # the same integers, other float orders


@needs_cuda
@pytest.mark.parametrize("qtype", NIBBLE_FORMATS, ids=lambda t: t.name)
def test_a_rows_result_does_not_depend_on_its_neighbours(qtype: GGMLQuantizationType) -> None:
    k, n = 1024, 77
    matrix = _matrix(qtype, n, k, seed=9)
    x = torch.randn(8, k, generator=torch.Generator().manual_seed(5)).to(CUDA, torch.bfloat16)
    together = nibble_matmul(x, matrix)
    assert together.dtype == torch.bfloat16
    for row in range(8):
        assert torch.equal(nibble_matmul(x[row : row + 1].contiguous(), matrix)[0], together[row]), row
    assert torch.equal(nibble_matmul(x[:4].contiguous(), matrix), together[:4])


@needs_cuda
def test_half_outputs_and_strided_out() -> None:
    matrix = _matrix(GGMLQuantizationType.Q4_K, 40, 512, seed=3)
    x = torch.randn(2, 512, generator=torch.Generator().manual_seed(1)).to(CUDA, torch.float16)
    wide = torch.zeros(2, 64, dtype=torch.float16, device=CUDA)
    out = wide[:, 8:48]  # rows 64 apart: a strided destination
    nibble_matmul(x, matrix, out=out)
    assert torch.equal(out, nibble_matmul(x, matrix))
    assert bool((wide[:, :8] == 0).all()) and bool((wide[:, 48:] == 0).all())
