"""Loading Hugging Face checkpoint directories written by transformers' `save_pretrained`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash.errors import ModelLoadError
from dflash.models.checkpoint import expected_shapes
from dflash.models.hf_loader import load_hf_dir
from dflash.models.resolve import load_checkpoint
from dflash.tokenizer import Tokenizer
from tests.loading_helpers import CHATML, train_byte_level_tokenizer

transformers = pytest.importorskip("transformers")

SMALL = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
}


def _write_tokenizer(path: Path, **config: Any) -> None:
    train_byte_level_tokenizer().save(str(path / "tokenizer.json"))
    tok_config = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "chat_template": CHATML, **config}
    (path / "tokenizer_config.json").write_text(json.dumps(tok_config))


def _save(model: Any, path: Path, **kwargs: Any) -> dict[str, torch.Tensor]:
    model.save_pretrained(str(path), **kwargs)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _tiny(arch: str, tie: bool) -> Any:
    torch.manual_seed(0)
    vocab = train_byte_level_tokenizer().get_vocab_size()
    if arch == "llama":
        cfg = transformers.LlamaConfig(vocab_size=vocab, tie_word_embeddings=tie, eos_token_id=0, **SMALL)
        return transformers.LlamaForCausalLM(cfg)
    if arch == "qwen3":
        cfg = transformers.Qwen3Config(
            vocab_size=vocab, tie_word_embeddings=tie, head_dim=16, eos_token_id=0, **SMALL
        )
        return transformers.Qwen3ForCausalLM(cfg)
    cfg = transformers.Gemma3TextConfig(
        vocab_size=vocab,
        tie_word_embeddings=tie,
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=8,
        **SMALL,
    )
    return transformers.Gemma3ForCausalLM(cfg)


@pytest.mark.parametrize(
    ("arch", "tie"), [("llama", True), ("llama", False), ("qwen3", False), ("gemma3", True)]
)
def test_round_trip(tmp_path: Path, arch: str, tie: bool) -> None:
    model = _tiny(arch, tie)
    state = _save(model, tmp_path)
    _write_tokenizer(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2]}))
    ck = load_hf_dir(tmp_path)
    cfg = ck.config
    assert cfg.architecture == arch
    assert cfg.tie_word_embeddings == tie
    assert cfg.qk_norm == (arch != "llama")
    assert set(ck.weights) == set(expected_shapes(cfg))
    assert ("lm_head.weight" in ck.weights) == (not tie)
    for name, tensor in ck.weights.items():
        torch.testing.assert_close(tensor, state[name].float(), atol=0, rtol=0, msg=name)
    # EOS: the tokenizer's <|im_end|> (id 2), config.json's, generation_config.json's, without duplicates
    assert ck.tokenizer is not None
    assert ck.tokenizer.eos_token == "<|im_end|>"
    assert set(cfg.eos_token_ids) >= {0, 2} and len(set(cfg.eos_token_ids)) == len(cfg.eos_token_ids)
    assert ck.tokenizer.eos_token_ids == cfg.eos_token_ids
    assert ck.tokenizer.chat_template == CHATML
    assert ck.source == tmp_path
    if arch == "gemma3":
        assert "model.layers.1.pre_feedforward_layernorm.weight" in ck.weights
        assert cfg.query_pre_attn_scalar == 16 and cfg.sliding_window == 8


def test_dtype_and_dispatch(tmp_path: Path) -> None:
    state = _save(_tiny("llama", True), tmp_path)
    _write_tokenizer(tmp_path)
    ck = load_checkpoint(str(tmp_path), dtype=torch.bfloat16)
    assert {t.dtype for t in ck.weights.values()} == {torch.bfloat16}
    torch.testing.assert_close(ck.weights["model.norm.weight"], state["model.norm.weight"].to(torch.bfloat16))


def test_sharded_checkpoint(tmp_path: Path) -> None:
    state = _save(_tiny("llama", False), tmp_path, max_shard_size="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2, "the test needs a sharded checkpoint"
    ck = load_hf_dir(tmp_path)
    assert ck.tokenizer is None  # no tokenizer files in this directory
    for name, tensor in ck.weights.items():
        torch.testing.assert_close(tensor, state[name], atol=0, rtol=0)
    (tmp_path / shards[1]).unlink()
    with pytest.raises(
        ModelLoadError, match=f"shard {shards[1]} listed in model.safetensors.index.json is missing"
    ):
        load_hf_dir(tmp_path)


def test_shape_mismatch(tmp_path: Path) -> None:
    _save(_tiny("llama", True), tmp_path)
    weights = load_file(str(tmp_path / "model.safetensors"))
    weights["model.layers.1.mlp.down_proj.weight"] = torch.zeros(32, 48)
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError) as info:
        load_hf_dir(tmp_path)
    message = str(info.value)
    assert str(tmp_path) in message and "model.layers.1.mlp.down_proj.weight" in message
    assert "[32, 48]" in message and "[32, 64]" in message


def test_missing_tensor(tmp_path: Path) -> None:
    _save(_tiny("llama", True), tmp_path)
    weights = load_file(str(tmp_path / "model.safetensors"))
    del weights["model.layers.0.self_attn.k_proj.weight"]
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"missing tensor 'model.layers.0.self_attn.k_proj.weight'"):
        load_hf_dir(tmp_path)


def test_unknown_architecture(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "hidden_size": 8}))
    with pytest.raises(ModelLoadError, match="unknown model_type 'gpt2'") as info:
        load_hf_dir(tmp_path)
    assert "config.json" in str(info.value)


def test_missing_config_and_weights(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"config\.json: missing"):
        load_hf_dir(tmp_path)
    _save(_tiny("llama", True), tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"no model\.safetensors"):
        load_hf_dir(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(ModelLoadError, match="cannot be read as safetensors"):
        load_hf_dir(tmp_path)


def test_chat_template_files(tmp_path: Path) -> None:
    _save(_tiny("llama", True), tmp_path)
    _write_tokenizer(
        tmp_path, chat_template=[{"name": "default", "template": "DEFAULT"}, {"name": "x", "template": "X"}]
    )
    assert _tokenizer(tmp_path).chat_template == "DEFAULT"
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": "FROM JSON"}))
    assert _tokenizer(tmp_path).chat_template == "FROM JSON"
    (tmp_path / "chat_template.jinja").write_text("FROM JINJA")
    assert _tokenizer(tmp_path).chat_template == "FROM JINJA"


def _tokenizer(path: Path) -> Tokenizer:
    tok = load_hf_dir(path).tokenizer
    assert tok is not None
    return tok


def test_add_bos_follows_tokenizer_config(tmp_path: Path) -> None:
    _save(_tiny("llama", True), tmp_path)
    _write_tokenizer(tmp_path, add_bos_token=True)
    tok = load_hf_dir(tmp_path).tokenizer
    assert tok is not None and tok.add_bos and tok.bos_token == "<|im_start|>"
    assert tok.encode("hi", add_special_tokens=True) == [1, *tok.encode("hi")]
    _write_tokenizer(tmp_path)  # no add_bos_token and no BOS-adding post-processor
    assert _tokenizer(tmp_path).add_bos is False
