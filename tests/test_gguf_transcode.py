"""Q5_0 matrices rewritten as Q8_0 at load (`dflash.models.gguf_transcode`): exact, and read by the quantized path."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from dflash.models.cpu_matmul import int8_only_formats
from dflash.models.gguf_quantized import load_gguf_quantized, reads_format
from dflash.models.gguf_transcode import effective_format, transcode_blocks

Q5_0, Q8_0, Q4_K = GGMLQuantizationType.Q5_0, GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_K


def test_q5_0_blocks_become_q8_0_blocks_of_the_same_values() -> None:
    rng = np.random.default_rng(0)
    weights = rng.standard_normal((6, 256)).astype(np.float32) * np.linspace(0.01, 3.0, 256, dtype=np.float32)
    weights[0, :32] = 0.0  # an all-zero block (scale 0)
    stored = np.ascontiguousarray(quantize(weights, Q5_0))  # [6, 8 * 22]
    rewritten = transcode_blocks(torch.from_numpy(stored.copy()), Q5_0)
    assert rewritten.dtype == torch.uint8 and tuple(rewritten.shape) == (6, 8 * 34)
    np.testing.assert_array_equal(dequantize(rewritten.numpy(), Q8_0), dequantize(stored, Q5_0))
    # every one of the 32 codes appears, so each fifth bit and nibble position was read
    codes = rewritten.numpy().reshape(6, 8, 34)[..., 2:].view(np.int8)
    assert set(np.unique(codes).tolist()) == set(range(-16, 16))


def test_other_formats_pass_through_and_q5_0_counts_as_q8_0() -> None:
    blocks = torch.arange(144, dtype=torch.uint8)[None]
    assert transcode_blocks(blocks, Q4_K) is blocks
    assert effective_format(Q5_0) == Q8_0 and effective_format(Q4_K) == Q4_K
    assert reads_format("cpu", Q5_0) and reads_format("cuda", Q5_0)
    assert not reads_format("cpu", GGMLQuantizationType.Q5_1)
    assert int8_only_formats([Q5_0, Q8_0]) == [] and int8_only_formats([Q5_0, Q4_K]) == ["Q4_K"]


@pytest.mark.slow
def test_packaged_gemma_loads_quantized_with_its_q5_0_matrices(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Gemma-3-270M's Q4_K_M file holds Q5_0 matrices: they load as Q8_0 blocks with their exact values."""
    from dflash.models.gguf_file import GGUFFile
    from dflash.models.packaged import gemma3_270m_path

    monkeypatch.setenv("DFLASH_CACHE_DIR", str(tmp_path))
    path = gemma3_270m_path()
    if path is None:
        pytest.skip("Gemma-3-270M packages not installed")
    gguf = GGUFFile(path)
    q5 = [name for name, info in gguf.tensors.items() if info.qtype == Q5_0]
    assert q5
    checkpoint = load_gguf_quantized(path)
    assert Q5_0 not in checkpoint.matrix_formats() and Q8_0 in checkpoint.matrix_formats()
    name = q5[0]  # blk.N.attn_k.weight: llama's Q/K row order undone, as for every format
    layer = int(name.split(".")[1])
    matrix = checkpoint.matrices[f"model.layers.{layer}.self_attn.k_proj.weight"]
    values = dequantize(matrix.blocks.numpy(), Q8_0)  # [rows, columns]
    original = dequantize(np.asarray(gguf.raw(gguf.tensors[name])), Q5_0)
    assert sorted(map(tuple, values.tolist())) == sorted(map(tuple, original.tolist()))
