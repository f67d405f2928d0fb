"""GGUF matrices kept as blocks in every stored format (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K): row operations on the
bytes, and which kernels read which formats (the CPU's int8 kernel and the GPU programs every one, the CPU's
float32 and bf16 kernels Q4_1 and Q8_0)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from dflash.bench.random_gguf import random_blocks, write_random_gguf
from dflash.errors import ModelLoadError
from dflash.models.gguf_quantized import load_gguf_quantized
from dflash.models.quantized_layers import QuantizedEmbedding, QuantizedLinear
from dflash.models.quantized_weights import (
    STORED_BLOCKS,
    QuantizedMatrix,
    float_kernels_read,
    is_gpu_supported_type,
    is_supported_type,
)
from dflash.models.resolve import load_checkpoint

T = GGMLQuantizationType
K_FORMATS = [T.Q4_K, T.Q5_K, T.Q6_K]


def k_blocks(rows: int, columns: int, qtype: GGMLQuantizationType, seed: int = 0) -> np.ndarray:
    """[rows, bytes per row] random blocks of `qtype` with finite scales (Q5_K: random bytes, fixed d and dmin)."""
    rng = np.random.default_rng(seed)
    if qtype == T.Q5_K:
        blocks = rng.integers(0, 256, (rows * columns // 256, 176), dtype=np.uint8)
        blocks[:, 0:4] = np.array([1.2e-4, 9.0e-4], dtype="<f2").view(np.uint8)
        return blocks.reshape(rows, -1)
    return random_blocks(rows, columns, qtype, rng)


def test_the_cpu_and_gpu_read_their_own_formats() -> None:
    stored = [T.Q4_0, T.Q4_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K]
    assert list(STORED_BLOCKS) == stored
    assert all(is_supported_type(t) and is_gpu_supported_type(t) for t in stored)
    assert [t for t in stored if float_kernels_read(t)] == [T.Q4_1, T.Q8_0]
    for other in (T.F32, T.Q2_K, T.Q5_0):
        assert not is_supported_type(other) and not is_gpu_supported_type(other) and not float_kernels_read(other)


@pytest.mark.parametrize("qtype", K_FORMATS)
def test_k_quant_rows_permute_and_stack_on_the_bytes(qtype: GGMLQuantizationType) -> None:
    """Super-block rows are independent: a permutation of the byte rows is the permutation of the values, and
    stacked matrices dequantise to the stacked values."""
    columns = 512
    first, second = k_blocks(6, columns, qtype, 1), k_blocks(3, columns, qtype, 2)
    matrix = QuantizedMatrix(torch.from_numpy(first), qtype, columns)
    assert matrix.shape == (6, columns) and matrix.blocks.shape[1] == columns // 256 * STORED_BLOCKS[qtype][1]
    order = [3, 0, 5, 1, 4, 2]
    values = dequantize(first, qtype)  # [6, columns]
    np.testing.assert_array_equal(dequantize(first[order], qtype), values[order])
    stacked = QuantizedMatrix.stack_rows([matrix, QuantizedMatrix(torch.from_numpy(second), qtype, columns)], "x")
    expected = np.concatenate([values, dequantize(second, qtype)])
    np.testing.assert_array_equal(dequantize(stacked.blocks.numpy(), qtype), expected)


def test_wrong_sizes_and_unstored_formats_are_refused() -> None:
    with pytest.raises(ModelLoadError, match="whole blocks of 256"):
        QuantizedMatrix(torch.zeros(2, 144, dtype=torch.uint8), T.Q4_K, 128)
    with pytest.raises(ModelLoadError, match=r"uint8 \[rows, 288\]"):
        QuantizedMatrix(torch.zeros(2, 144, dtype=torch.uint8), T.Q4_K, 512)
    with pytest.raises(ModelLoadError, match="Q2_K are not supported"):
        QuantizedMatrix(torch.zeros(2, 84, dtype=torch.uint8), T.Q2_K, 256)


@pytest.mark.parametrize("qtype", K_FORMATS)
def test_the_cpu_modules_take_k_formats_on_the_int8_kernel_only(qtype: GGMLQuantizationType) -> None:
    """A K-format matrix starts on int8x2 products and refuses the float32 and AMX kernels; its embedding rows
    are `gguf`'s dequantised values."""
    blocks = k_blocks(4, 256, qtype)
    matrix = QuantizedMatrix(torch.from_numpy(blocks), qtype, 256)
    linear = QuantizedLinear(matrix)
    assert linear.products == "int8x2"
    for products in ("float32", "amx"):
        with pytest.raises(ModelLoadError, match=f"--cpu-matmul {products} reads Q4_1 and Q8_0 matrices only, not"):
            linear.use_products(products)
    embedding = QuantizedEmbedding(matrix)
    ids = torch.tensor([[3, 0], [1, 3]])
    assert torch.equal(embedding(ids), torch.from_numpy(dequantize(blocks, qtype))[ids])


def test_a_q4_k_m_file_loads_quantized_for_the_cpu_and_the_gpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """For either device every matrix stays as its file's blocks."""
    monkeypatch.setenv("DFLASH_NO_CACHE", "1")
    path = write_random_gguf(tmp_path / "tiny.gguf", "tiny", "q4_k_m")
    for device in ("cpu", "cuda"):
        checkpoint = load_checkpoint(path, weights="quantized", quantized_for=device)
        assert checkpoint.type_counts() == {"Q4_K": 13, "Q6_K": 3}
        down = checkpoint.matrices["model.layers.1.mlp.down_proj.weight"]  # a layer given more bits
        assert down.qtype == T.Q6_K and down.shape == (256, 512)
    assert load_gguf_quantized(path).matrix_formats() == {T.Q4_K, T.Q6_K}
