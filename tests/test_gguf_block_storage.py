"""GGUF matrices kept as blocks in every stored format (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K): row operations on the
bytes, and which device's quantized code accepts which file."""

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
    assert [t for t in STORED_BLOCKS if is_supported_type(t)] == [T.Q4_1, T.Q8_0]
    assert all(is_gpu_supported_type(t) for t in (T.Q4_0, T.Q4_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K))
    assert not is_gpu_supported_type(T.F32) and not is_gpu_supported_type(T.Q2_K)


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


def test_the_cpu_modules_refuse_what_their_kernel_cannot_read() -> None:
    matrix = QuantizedMatrix(torch.from_numpy(k_blocks(4, 256, T.Q4_K)), T.Q4_K, 256)
    for module in (QuantizedLinear, QuantizedEmbedding):
        with pytest.raises(ModelLoadError, match=r"Q4_K are not supported \(Q4_1, Q8_0 are\)"):
            module(matrix)


def test_a_q4_k_m_file_loads_quantized_for_the_gpu_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU refuses it with its kernel's formats named; for the GPU every matrix stays as its file's blocks."""
    monkeypatch.setenv("DFLASH_NO_CACHE", "1")
    path = write_random_gguf(tmp_path / "tiny.gguf", "tiny", "q4_k_m")
    with pytest.raises(ModelLoadError, match=r"Q4_K, Q6_K .*the quantized CPU kernel reads Q4_1 and Q8_0"):
        load_gguf_quantized(path)
    checkpoint = load_checkpoint(path, weights="quantized", quantized_for="cuda")
    assert checkpoint.type_counts() == {"Q4_K": 13, "Q6_K": 3}
    down = checkpoint.matrices["model.layers.1.mlp.down_proj.weight"]  # a layer given more bits
    assert down.qtype == T.Q6_K and down.shape == (256, 512)
