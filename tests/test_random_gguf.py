"""`dflash bench make-gguf`: random-weight GGUF files at real shapes load, and carry llama.cpp's quant mix."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader

from dflash.bench.random_gguf import SHAPES, more_bits, write_random_gguf
from dflash.models.gguf_loader import load_gguf
from dflash.models.registry import build_model


@pytest.mark.parametrize("mix", ["q8_0", "q4_1", "q4_0", "q4_k_m"])
def test_a_random_file_loads_with_its_shape_and_sane_weights(tmp_path: Path, mix: str) -> None:
    path = write_random_gguf(tmp_path / f"tiny_{mix}.gguf", "tiny", mix)
    checkpoint = load_gguf(path, use_cache=False)
    config, shape = checkpoint.config, SHAPES["tiny"]
    assert config.architecture == "qwen3" and config.qk_norm
    assert (config.num_layers, config.hidden_size, config.intermediate_size) == (
        shape.layers, shape.hidden, shape.intermediate
    )
    assert (config.num_heads, config.num_kv_heads, config.head_dim, config.vocab_size) == (
        shape.heads, shape.kv_heads, shape.head_dim, shape.vocab
    )
    for name, weight in checkpoint.weights.items():
        if weight.dim() == 2:  # matrices spread like N(0, 0.02), centred
            assert 0.01 < weight.float().std().item() < 0.05, name
            assert abs(weight.float().mean().item()) < 0.005, name
    assert checkpoint.tokenizer is not None
    model = build_model(config, checkpoint.weights)
    logits = model(torch.randint(0, config.vocab_size, (1, 6))).logits
    assert logits is not None and torch.isfinite(logits).all()


def test_q4_k_m_gives_six_bits_where_llama_cpp_does(tmp_path: Path) -> None:
    path = write_random_gguf(tmp_path / "tiny.gguf", "tiny", "q4_k_m")
    kinds = {t.name: GGMLQuantizationType(t.tensor_type) for t in GGUFReader(str(path)).tensors}
    assert kinds["output.weight"] == GGMLQuantizationType.Q6_K
    assert kinds["blk.0.attn_q.weight"] == GGMLQuantizationType.Q4_K
    assert kinds["blk.0.attn_norm.weight"] == GGMLQuantizationType.F32
    for layer in range(SHAPES["tiny"].layers):
        rich = GGMLQuantizationType.Q6_K if more_bits(layer, SHAPES["tiny"].layers) else GGMLQuantizationType.Q4_K
        assert kinds[f"blk.{layer}.attn_v.weight"] == rich and kinds[f"blk.{layer}.ffn_down.weight"] == rich
    # llama.cpp's rule on 36 layers: the first and last eighth, and every third layer in between
    assert [i for i in range(36) if more_bits(i, 36)] == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 30, 31, 32, 33, 34, 35]


def test_unknown_shapes_and_mixes_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown shape"):
        write_random_gguf(tmp_path / "x.gguf", "qwen9-1t", "q8_0")
    with pytest.raises(ValueError, match="unknown quant mix"):
        write_random_gguf(tmp_path / "x.gguf", "tiny", "q3_k_s")
    with pytest.raises(ValueError, match="rows of 576 values are not whole 256-value super-blocks"):
        write_random_gguf(tmp_path / "x.gguf", "smollm2-135m", "q4_k_m")
