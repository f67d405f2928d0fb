"""GGUF loading on small files written here: conventions undone, quant types, errors, cache."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from dflash.config import FULL_ATTENTION, SLIDING_ATTENTION
from dflash.errors import ModelLoadError
from dflash.models import gguf_cache, gguf_loader
from dflash.models.gguf_config import llama3_factors
from dflash.models.gguf_file import GGUFFile
from dflash.models.gguf_loader import hf_tensor_name, load_gguf
from tests.loading_helpers import (
    TINY,
    quantized,
    smollm2_path,
    tiny_model_gguf,
    train_byte_level_tokenizer,
    write_gguf,
)


@pytest.fixture(autouse=True)
def _private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "cache"
    monkeypatch.setenv("DFLASH_CACHE_DIR", str(cache))
    monkeypatch.delenv("DFLASH_NO_CACHE", raising=False)
    return cache


def _assert_weights(got: dict[str, torch.Tensor], want: dict[str, np.ndarray], atol: float = 1e-6) -> None:
    assert set(got) == set(want)
    for name, value in want.items():
        assert got[name].dtype == torch.float32
        torch.testing.assert_close(got[name], torch.from_numpy(value), atol=atol, rtol=0, msg=name)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_tiny_gguf_round_trip(tmp_path: Path, arch: str) -> None:
    path = tmp_path / f"tiny-{arch}.gguf"
    want, _ = tiny_model_gguf(path, arch)
    ck = load_gguf(path)
    _assert_weights(ck.weights, want)
    cfg = ck.config
    assert cfg.architecture == arch
    assert (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (32, 4, 2, 8)
    assert cfg.num_layers == 2 and cfg.intermediate_size == 64
    assert cfg.vocab_size == want["model.embed_tokens.weight"].shape[0]
    assert cfg.tie_word_embeddings == (arch != "qwen3")
    assert cfg.qk_norm == (arch != "llama")
    assert cfg.rms_norm_eps == 1e-6  # float32 metadata read back as the decimal it was written as
    if arch == "gemma3":
        assert cfg.layer_types == (SLIDING_ATTENTION, SLIDING_ATTENTION)
        assert cfg.sliding_window == 16
        assert cfg.hidden_act == "gelu_pytorch_tanh"
        assert cfg.rope_local_theta == 10000.0
        assert cfg.query_pre_attn_scalar == 8.0
        assert cfg.embed_scale == pytest.approx(32**0.5)
    else:
        assert cfg.layer_types == (FULL_ATTENTION, FULL_ATTENTION)
        assert cfg.hidden_act == "silu"
    assert ck.tokenizer is not None
    assert cfg.eos_token_ids == ck.tokenizer.eos_token_ids
    assert ck.tokenizer.token_to_id("<|im_end|>") in cfg.eos_token_ids  # end of turn of the ChatML template


def test_llama_qk_unpermute_matches_rotate_half_layout(tmp_path: Path) -> None:
    # With the permutation undone, row j and row j + d/2 of a head form one RoPE pair again.
    path = tmp_path / "tiny.gguf"
    want, _ = tiny_model_gguf(path, "llama", seed=3)
    raw = GGUFFile(path)
    stored = raw.dequantize(raw.tensors["blk.0.attn_q.weight"])
    assert not np.allclose(
        stored, want["model.layers.0.self_attn.q_proj.weight"]
    )  # the file really is permuted
    loaded = load_gguf(path).weights["model.layers.0.self_attn.q_proj.weight"].numpy()
    np.testing.assert_array_equal(loaded, want["model.layers.0.self_attn.q_proj.weight"])
    hd = TINY["head_dim"]
    np.testing.assert_array_equal(stored[1], loaded[hd // 2])  # interleaved pair (0, 1) is rows (0, d/2)


def test_dtype_is_honoured(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    want, _ = tiny_model_gguf(path, "llama")
    ck = load_gguf(path, dtype=torch.bfloat16)
    assert {t.dtype for t in ck.weights.values()} == {torch.bfloat16}
    torch.testing.assert_close(
        ck.weights["model.norm.weight"], torch.from_numpy(want["model.norm.weight"]).to(torch.bfloat16)
    )


QUANT_TYPES = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1]
RAW_ONLY_TYPES = [Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_NL, Q.IQ4_XS]


def test_every_quant_type_matches_gguf_reader(tmp_path: Path) -> None:
    """Tensor bytes located by our reader, dequantised, equal what gguf's own reader gives."""
    rng = np.random.default_rng(0)
    values = rng.standard_normal((4, 512)).astype(np.float32)
    tensors: dict[str, Any] = {}
    for qt in QUANT_TYPES:
        if qt == Q.F32:
            tensors["t_F32"] = values
        elif qt == Q.F16:
            tensors["t_F16"] = (values.astype(np.float16).view(np.uint8), qt)
        else:
            tensors[f"t_{qt.name}"] = quantized(values, qt)
    for qt in RAW_ONLY_TYPES:  # no quantiser in gguf-py: random blocks with finite scales
        block, size = gguf.GGML_QUANT_SIZES[qt]
        raw = rng.integers(0, 256, size=(4, 512 // block * size), dtype=np.uint8)
        tensors[f"t_{qt.name}"] = (
            raw & 0x3B,
            qt,
        )  # keeps every f16 exponent below all-ones: no inf/NaN scales
    path = write_gguf(tmp_path / "quants.gguf", "llama", {}, tensors)
    ours = GGUFFile(path)
    reference = {t.name: t for t in gguf.GGUFReader(path).tensors}
    for name, info in ours.tensors.items():
        ref = reference[name]
        expected = gguf.quants.dequantize(ref.data, ref.tensor_type).reshape(4, 512)
        got = ours.dequantize(info)
        assert got.shape == (4, 512) and got.dtype == np.float32, name
        np.testing.assert_array_equal(got, expected, err_msg=name)
    # and the values survive quantisation to the precision each type has
    np.testing.assert_allclose(ours.dequantize(ours.tensors["t_Q8_0"]), values, atol=0.05)
    np.testing.assert_array_equal(ours.dequantize(ours.tensors["t_F32"]), values)


def test_metadata_matches_gguf_reader_on_real_file() -> None:
    path = smollm2_path()
    ours = GGUFFile(path)
    reader = gguf.GGUFReader(path)
    keys = {k for k in reader.fields if not k.startswith("GGUF.")}
    assert keys == set(ours.metadata)
    for key in keys:
        value = reader.fields[key].contents()
        if isinstance(value, float):
            assert ours.metadata[key] == pytest.approx(value, rel=1e-6), key
        else:
            assert ours.metadata[key] == value, key
    assert [t.name for t in reader.tensors] == list(ours.tensors)
    for t in reader.tensors:
        info = ours.tensors[t.name]
        assert info.offset == t.data_offset and info.n_bytes == t.n_bytes
        assert info.shape == tuple(int(d) for d in reversed(t.shape))


def test_tensor_names() -> None:
    assert hf_tensor_name("llama", "token_embd.weight") == "model.embed_tokens.weight"
    assert hf_tensor_name("llama", "output.weight") == "lm_head.weight"
    assert hf_tensor_name("llama", "blk.12.attn_output.weight") == "model.layers.12.self_attn.o_proj.weight"
    assert hf_tensor_name("qwen3", "blk.0.attn_k_norm.weight") == "model.layers.0.self_attn.k_norm.weight"
    assert (
        hf_tensor_name("llama", "blk.3.ffn_norm.weight") == "model.layers.3.post_attention_layernorm.weight"
    )
    assert (
        hf_tensor_name("gemma3", "blk.3.ffn_norm.weight") == "model.layers.3.pre_feedforward_layernorm.weight"
    )
    assert hf_tensor_name("gemma3", "blk.3.post_attention_norm.weight") == (
        "model.layers.3.post_attention_layernorm.weight"
    )
    assert (
        hf_tensor_name("gemma3", "blk.3.post_ffw_norm.weight")
        == "model.layers.3.post_feedforward_layernorm.weight"
    )
    assert hf_tensor_name("llama", "blk.0.attn_q.bias") == "model.layers.0.self_attn.q_proj.bias"
    assert hf_tensor_name("llama", "blk.0.ssm_conv1d.weight") is None


# ------------------------------------------------------------------------------------------------ errors
def test_truncated_real_gguf(tmp_path: Path) -> None:
    src = smollm2_path()
    cut = tmp_path / "cut.gguf"
    with src.open("rb") as fh:
        cut.write_bytes(fh.read(src.stat().st_size // 2))
    with pytest.raises(ModelLoadError, match="truncated GGUF file") as info:
        load_gguf(cut)
    assert str(cut) in str(info.value) and "tensor" in str(info.value)


def test_truncated_header(tmp_path: Path) -> None:
    src = smollm2_path()
    cut = tmp_path / "header.gguf"
    with src.open("rb") as fh:
        cut.write_bytes(fh.read(5000))  # inside the token list
    with pytest.raises(ModelLoadError, match="truncated or corrupt GGUF header") as info:
        load_gguf(cut)
    assert str(cut) in str(info.value)


def test_truncated_small_file_last_tensor(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    tiny_model_gguf(path, "llama")
    data = path.read_bytes()
    path.write_bytes(data[:-7])
    with pytest.raises(ModelLoadError, match=r"truncated GGUF file: tensor 'output_norm.weight'"):
        load_gguf(path)


def test_not_a_gguf(tmp_path: Path) -> None:
    bogus = tmp_path / "model.gguf"
    bogus.write_bytes(b"PK\x03\x04" + b"\0" * 100)
    with pytest.raises(ModelLoadError, match="not a GGUF file") as info:
        load_gguf(bogus)
    assert str(bogus) in str(info.value)
    tiny = tmp_path / "tiny.gguf"
    tiny.write_bytes(b"GG")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        load_gguf(tiny)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no such GGUF file"):
        load_gguf(tmp_path / "absent.gguf")


def test_unknown_architecture(tmp_path: Path) -> None:
    path = write_gguf(
        tmp_path / "gpt2.gguf", "gpt2", {"gpt2.block_count": 1}, {"token_embd.weight": np.zeros((4, 4))}
    )
    with pytest.raises(ModelLoadError, match="unsupported GGUF architecture 'gpt2'") as info:
        load_gguf(path)
    assert str(path) in str(info.value)


def test_shape_mismatch(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    _, md = tiny_model_gguf(path, "llama")
    # Rewrite the file claiming a wider feed-forward than the tensors have.
    raw = GGUFFile(path)
    tensors = {name: raw.dequantize(info) for name, info in raw.tensors.items()}
    bad = write_gguf(tmp_path / "bad.gguf", "llama", {**md, "llama.feed_forward_length": 96}, tensors)
    with pytest.raises(ModelLoadError) as info:
        load_gguf(bad)
    message = str(info.value)
    assert str(bad) in message and "mlp.gate_proj.weight" in message
    assert "[64, 32]" in message and "[96, 32]" in message


def test_unknown_tensor(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    _, md = tiny_model_gguf(path, "llama")
    raw = GGUFFile(path)
    tensors = {name: raw.dequantize(info) for name, info in raw.tensors.items()}
    tensors["blk.0.ssm_a.weight"] = np.zeros(4, dtype=np.float32)
    bad = write_gguf(tmp_path / "extra.gguf", "llama", md, tensors)
    with pytest.raises(ModelLoadError, match="ssm_a"):
        load_gguf(bad)


def test_missing_tensor(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    _, md = tiny_model_gguf(path, "llama")
    raw = GGUFFile(path)
    tensors = {
        name: raw.dequantize(info) for name, info in raw.tensors.items() if name != "blk.1.ffn_up.weight"
    }
    bad = write_gguf(tmp_path / "missing.gguf", "llama", md, tensors)
    with pytest.raises(ModelLoadError, match=r"missing tensor 'model.layers.1.mlp.up_proj.weight'"):
        load_gguf(bad)


# ------------------------------------------------------------------------------------------- rope scaling
def test_llama3_rope_freqs_become_rope_scaling(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    _, md = tiny_model_gguf(path, "llama")
    raw = GGUFFile(path)
    tensors = {name: raw.dequantize(info) for name, info in raw.tensors.items()}
    hd = TINY["head_dim"]
    # base 500000 (Llama 3's) gives this tiny head_dim all three regimes: kept, interpolated, scaled
    factors = llama3_factors(500000.0, hd, 8.0, 1.0, 4.0, 8192).astype(np.float32)
    assert factors[0] == 1.0 and 1.0 < factors[2] < 8.0 and factors[3] == 8.0
    tensors["rope_freqs.weight"] = factors
    md = {**md, "llama.rope.freq_base": 500000.0}
    scaled = write_gguf(tmp_path / "scaled.gguf", "llama", md, tensors)
    cfg = load_gguf(scaled).config
    assert cfg.rope_scaling == {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    tensors["rope_freqs.weight"] = np.linspace(1, 3, hd // 2).astype(np.float32)
    odd = write_gguf(tmp_path / "odd.gguf", "llama", md, tensors)
    with pytest.raises(ModelLoadError, match="rope_freqs"):
        load_gguf(odd)


def test_linear_rope_scaling_metadata(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    _, md = tiny_model_gguf(path, "gemma3")
    raw = GGUFFile(path)
    tensors = {name: raw.dequantize(info) for name, info in raw.tensors.items()}
    md = {**md, "gemma3.rope.scaling.type": "linear", "gemma3.rope.scaling.factor": 8.0}
    cfg = load_gguf(write_gguf(tmp_path / "lin.gguf", "gemma3", md, tensors)).config
    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 8.0}


# ------------------------------------------------------------------------------------------------- cache
def test_cache_round_trip(tmp_path: Path, _private_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "tiny.gguf"
    want, _ = tiny_model_gguf(path, "gemma3")
    monkeypatch.setattr(gguf_loader, "CACHE_MIN_SECONDS", 0.0)
    first = load_gguf(path)
    files = sorted(p.name for p in (_private_cache / "gguf").iterdir())
    assert len(files) == 3 and any(f.endswith(".safetensors") for f in files)

    def no_parse(*args: object) -> None:
        raise AssertionError("the GGUF was parsed although a cache entry exists")

    monkeypatch.setattr(gguf_loader, "GGUFFile", no_parse)
    second = load_gguf(path)
    _assert_weights(second.weights, want)
    assert second.config == first.config
    assert second.tokenizer is not None and first.tokenizer is not None
    text = "Hello world! <|im_end|>"
    assert second.tokenizer.encode(text) == first.tokenizer.encode(text)
    assert second.tokenizer.eos_token_ids == first.tokenizer.eos_token_ids
    assert second.tokenizer.chat_template == first.tokenizer.chat_template
    assert load_gguf(path, dtype=torch.float16).weights["model.norm.weight"].dtype == torch.float16


def test_cache_invalidated_when_file_changes(
    tmp_path: Path, _private_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "tiny.gguf"
    tiny_model_gguf(path, "llama", seed=1)
    monkeypatch.setattr(gguf_loader, "CACHE_MIN_SECONDS", 0.0)
    load_gguf(path)
    want, _ = tiny_model_gguf(tmp_path / "other.gguf", "llama", seed=2)
    shutil.copy(tmp_path / "other.gguf", path)  # same path, new content and mtime
    _assert_weights(load_gguf(path).weights, want)
    assert len(list((_private_cache / "gguf").glob("*.safetensors"))) == 1  # the stale entry was replaced


def test_cache_disabled(tmp_path: Path, _private_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "tiny.gguf"
    tiny_model_gguf(path, "llama")
    monkeypatch.setattr(gguf_loader, "CACHE_MIN_SECONDS", 0.0)
    monkeypatch.setenv("DFLASH_NO_CACHE", "1")
    load_gguf(path)
    assert not (_private_cache / "gguf").exists()
    assert gguf_cache.load_cached(path) is None


def test_damaged_cache_entry_is_ignored(
    tmp_path: Path, _private_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "tiny.gguf"
    want, _ = tiny_model_gguf(path, "llama")
    monkeypatch.setattr(gguf_loader, "CACHE_MIN_SECONDS", 0.0)
    load_gguf(path)
    for weights_file in (_private_cache / "gguf").glob("*.safetensors"):
        weights_file.write_bytes(b"garbage")
    _assert_weights(load_gguf(path).weights, want)


def test_progress_callback(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    want, _ = tiny_model_gguf(path, "llama")
    calls: list[tuple[int, int]] = []
    load_gguf(path, progress=lambda done, total: calls.append((done, total)), use_cache=False)
    assert calls[-1] == (len(want), len(want)) and len(calls) == len(want)


def test_tokenizer_from_tiny_gguf_matches_trained_tokenizer(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    tiny_model_gguf(path, "llama")
    tok = load_gguf(path).tokenizer
    assert tok is not None
    reference = train_byte_level_tokenizer()
    for text in [
        "The quick brown fox",
        "def add(a, b):\n    return a + b",
        "naïve café 😀 日本語",
        "  spaces  ",
    ]:
        assert tok.encode(text) == reference.encode(text).ids, text
        assert tok.decode(tok.encode(text)) == text
    assert tok.encode("<|im_start|>user") == [1, *reference.encode("user").ids]
