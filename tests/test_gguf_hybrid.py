"""Qwen3.5 GGUF files (llama.cpp's `qwen35`): a tiny transformers model written the way llama.cpp's converter
writes it loads back to the same weights and the same logits."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from dflash.errors import ModelLoadError
from dflash.models.gguf_loader import load_gguf
from dflash.models.registry import build_model
from tests.hybrid_gguf import convert_hybrid, hybrid_metadata
from tests.hybrid_models import TINY_HYBRID, hf_tiny_hybrid
from tests.loading_helpers import write_gguf
from tests.spec_helpers import one_torch_thread

transformers = pytest.importorskip("transformers")
_threads = one_torch_thread


@pytest.fixture(scope="module")
def hf_model() -> Any:
    # llama.cpp derives the layer kinds from the interval: every 4th layer is full attention
    layer_types = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]
    return hf_tiny_hybrid(seed=21, layer_types=layer_types)


def test_gguf_loads_as_transformers_weights(hf_model: Any, tmp_path: Path) -> None:
    tensors = convert_hybrid(hf_model)
    tensors["blk.4.nextn.eh_proj.weight"] = np.zeros((8, 8), dtype=np.float32)  # a multi-token-prediction block
    path = write_gguf(tmp_path / "tiny.gguf", "qwen35", hybrid_metadata(hf_model, mtp_layers=1), tensors)
    checkpoint = load_gguf(path, use_cache=False)
    config = checkpoint.config
    assert config.architecture == "qwen3_5" and config.num_layers == 4 and config.rotary_dim == 4
    assert (config.linear_num_key_heads, config.linear_num_value_heads, config.linear_value_head_dim) == (2, 4, 12)
    expected = {k: v for k, v in hf_model.state_dict().items()}
    assert set(checkpoint.weights) == set(expected)
    for name, tensor in checkpoint.weights.items():
        torch.testing.assert_close(tensor, expected[name], atol=1e-5, rtol=1e-5, msg=name)
    model = build_model(config, checkpoint.weights)
    ids = torch.randint(0, TINY_HYBRID["vocab_size"], (1, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, hf_model(ids).logits, atol=1e-4, rtol=0)


def test_mixture_of_experts_hybrids_need_their_experthybrid_metadata(hf_model: Any, tmp_path: Path) -> None:
    """`qwen3next` and `qwen35moe` files are read (tests/test_gguf_hybrid_moe.py); without the expert keys they
    are a clear load error."""
    for arch in ("qwen3next", "qwen35moe"):
        md = {k.replace("qwen35.", f"{arch}."): v for k, v in hybrid_metadata(hf_model, 0).items()}
        path = write_gguf(tmp_path / f"{arch}.gguf", arch, md, {"token_embd.weight": np.zeros((8, 4), np.float32)})
        with pytest.raises(ModelLoadError, match=rf"lacks {arch}\.expert_count"):
            load_gguf(path, use_cache=False)

