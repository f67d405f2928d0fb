"""Gemma 4 text models: a tiny random transformers model with every layer kind (sliding and full attention with wider
heads and values from keys, K/V-sharing layers of both types with double-wide MLPs, per-layer inputs, a window
smaller than the prompt) loaded from an HF folder matches transformers in float32, and speculative decoding over it
stays lossless, alone and batched."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize
from safetensors.torch import load_file, save_file

from dflash.config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig
from dflash.drafter.model import DFlashDrafter
from dflash.engine.engine import EngineOptions, resolve_options
from dflash.engine.loading import load_engine
from dflash.errors import ModelLoadError
from dflash.fastpath import batched_step, fused_layers
from dflash.fastpath.batched_step import BatchedDecoder
from dflash.fastpath.static_forward import static_target_forward
from dflash.generation.request import GenerationRequest
from dflash.kernels.fused_cpu import torch_layer_ops
from dflash.models import gguf_loader
from dflash.models.gemma4 import Gemma4ForCausalLM, Gemma4RMSNorm
from dflash.models.gguf_loader import load_gguf
from dflash.models.hf_loader import load_hf_dir
from dflash.models.layers import RMSNorm
from dflash.models.model import CausalLM
from dflash.models.quantized_model import build_quantized_model
from dflash.models.quantized_weights import QuantizedCheckpoint
from dflash.models.registry import build_model
from dflash.models.weight_choice import choose_weights
from dflash.parallel.sharding import shard_config
from dflash.tokenizer import Tokenizer
from tests.family_checks import (
    SAMPLED_VOCAB,
    check_batched_core_equals_plain,
    check_linear_and_ddtree_equal_plain,
    check_sampling_keeps_the_distribution,
    tiny_drafter,
)
from tests.loading_helpers import (
    CHATML,
    gguf_tokenizer_metadata,
    quantized,
    train_byte_level_tokenizer,
    write_gguf,
)
from tests.spec_helpers import one_torch_thread, random_prompts, run
from tests.test_batched_step import step_logits
from tests.tiny_models import hf_tiny, ours_from_hf

transformers = pytest.importorskip("transformers")

_one_thread = one_torch_thread  # autouse, module scope

S, F = SLIDING_ATTENTION, FULL_ATTENTION
# Layers 5 and 6 share K/V: layer 5 (sliding) reads layer 3's, layer 6 (full) reads layer 4's.
LAYER_TYPES = [S, F, S, S, F, S, F]
WINDOW = 8
PROMPT_LEN, CHUNK = 40, 16  # the prompt spans three prefill chunks and five windows


def _hf_config(**overrides: Any) -> Any:
    settings: dict[str, Any] = dict(
        vocab_size=train_byte_level_tokenizer().get_vocab_size(), hidden_size=64, intermediate_size=96,
        num_hidden_layers=len(LAYER_TYPES), num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True, layer_types=list(LAYER_TYPES),
        sliding_window=WINDOW, num_kv_shared_layers=2, use_double_wide_mlp=True, hidden_size_per_layer_input=8,
        final_logit_softcapping=30.0, max_position_embeddings=256, initializer_range=0.08, eos_token_id=0,
        rope_parameters={
            S: {"rope_type": "default", "rope_theta": 10_000.0},
            F: {"rope_type": "proportional", "partial_rotary_factor": 0.5, "rope_theta": 1_000_000.0},
        },
    )
    settings.update(overrides)
    settings.setdefault("vocab_size_per_layer_input", settings["vocab_size"])
    return transformers.Gemma4TextConfig(**settings)


@cache
def hf_gemma4(**overrides: Any) -> Any:
    """transformers' Gemma4ForCausalLM (eager attention) with random weights, norms and layer scalars."""
    torch.manual_seed(0)
    config = _hf_config(**overrides)
    config._attn_implementation = "eager"
    model = transformers.Gemma4ForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:  # norms start at 1: randomise them so a misplaced norm shows
                param.add_(torch.randn_like(param) * 0.2)
        for index, layer in enumerate(model.model.layers):
            layer.layer_scalar.fill_(0.6 + 0.1 * index)
    return model


@cache
def target() -> CausalLM:
    return ours_from_hf(hf_gemma4())


def _prompt(seed: int, length: int = PROMPT_LEN) -> torch.Tensor:
    vocab = hf_gemma4().config.vocab_size
    return torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def _assert_matches_transformers(ours: CausalLM, hf: Any = None) -> None:
    """A whole-prompt forward, and chunked prefill then one-token steps through the cache, give transformers'
    logits within 1e-4."""
    ids = _prompt(1)
    reference = (hf or hf_gemma4())(ids).logits  # [1, seq, vocab]
    assert reference.abs().max().item() > 1.0  # logits large enough for a wrong detail to show
    whole = ours(ids).logits
    assert whole is not None and (whole - reference).abs().max().item() <= 1e-4
    kv = ours.new_cache(PROMPT_LEN)
    chunks = [ours(ids[:, lo : lo + CHUNK], cache=kv).logits for lo in range(0, PROMPT_LEN - 6, CHUNK)]
    for t in range(kv.length, PROMPT_LEN):
        chunks.append(ours(ids[:, t : t + 1], cache=kv).logits)
    logits = torch.cat([c for c in chunks if c is not None], dim=1)
    assert logits.shape == reference.shape
    assert (logits - reference).abs().max().item() <= 1e-4


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gemma4")
    hf_gemma4().save_pretrained(str(path))
    train_byte_level_tokenizer().save(str(path / "tokenizer.json"))
    tok_config = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "chat_template": CHATML}
    (path / "tokenizer_config.json").write_text(json.dumps(tok_config))
    return path


# ---- configuration -------------------------------------------------------------------------------------------


def test_config_reads_every_gemma4_field(hf_folder: Path) -> None:
    raw = json.loads((hf_folder / "config.json").read_text())
    config = ModelConfig.from_hf(raw)
    assert config.architecture == "gemma4" and config.layer_types == tuple(LAYER_TYPES)
    assert (config.head_dim, config.global_head_dim, config.num_kv_heads, config.global_num_kv_heads) == (16, 32, 2, 1)
    assert [config.layer_head_dim(i) for i in range(7)] == [16, 32, 16, 16, 32, 16, 32]
    assert [config.layer_kv_heads(i) for i in range(7)] == [2, 1, 2, 2, 1, 2, 1]
    assert (config.cache_head_dim, config.cache_kv_heads, config.cache_layers) == (32, 2, 5)
    assert [config.kv_source(i) for i in range(7)] == [0, 1, 2, 3, 4, 3, 4]
    assert [config.layer_intermediate_size(i) for i in range(7)] == [96] * 5 + [192] * 2
    assert config.attention_k_eq_v and config.attention_scale == 1.0 and config.qk_norm and not config.norm_adds_one
    assert config.embed_scale == pytest.approx(8.0) and config.tie_word_embeddings
    assert config.rope_scaling == {"rope_type": "proportional", "partial_rotary_factor": 0.5, "rope_theta": 1e6}
    assert (config.rope_theta, config.rope_local_theta, config.sliding_window) == (1e6, 1e4, WINDOW)
    assert (config.hidden_size_per_layer_input, config.vocab_size_per_layer_input) == (8, raw["vocab_size"])
    # Released checkpoints declare the wide layers with global_head_dim / num_global_key_value_heads instead,
    # nested under `text_config` of an image-text config.
    released = {k: v for k, v in raw.items() if k != "per_layer_config"}
    released.update(global_head_dim=32, num_global_key_value_heads=1)
    nested = {"model_type": "gemma4", "text_config": released, "eos_token_id": 0}
    assert ModelConfig.from_hf(nested) == config


def test_config_declines_what_it_cannot_run(hf_folder: Path) -> None:
    raw = json.loads((hf_folder / "config.json").read_text())
    with pytest.raises(ModelLoadError, match="mixture-of-experts"):
        ModelConfig.from_hf({**raw, "enable_moe_block": True, "num_experts": 4, "top_k_experts": 2})
    with pytest.raises(ModelLoadError, match="bidirectional"):
        ModelConfig.from_hf({**raw, "use_bidirectional_attention": "all"})
    with pytest.raises(ModelLoadError, match="no earlier layer"):  # every layer before the shared ones is sliding
        ModelConfig.from_hf({**raw, "layer_types": [S] * 6 + [F], "num_kv_shared_layers": 1, "per_layer_config": {}})
    with pytest.raises(ModelLoadError, match="per-layer head sizes"):
        ModelConfig.from_hf({**raw, "per_layer_config": {"1": {"head_dim": 32}, "4": {"head_dim": 64}}})
    # transformers makes the last layer full attention whatever the list says
    forced = ModelConfig.from_hf({**raw, "layer_types": [*LAYER_TYPES[:-1], S]})
    assert forced.layer_types[-1] == F


# ---- loading and parity --------------------------------------------------------------------------------------


def test_hf_folder_loads_and_matches_transformers(hf_folder: Path) -> None:
    checkpoint = load_hf_dir(hf_folder)
    assert "model.layers.6.self_attn.k_proj.weight" not in checkpoint.weights  # shared layers have none
    assert "model.layers.4.self_attn.v_proj.weight" not in checkpoint.weights  # values come from keys there
    assert checkpoint.tokenizer is not None
    model = build_model(checkpoint.config, checkpoint.weights)
    assert isinstance(model, Gemma4ForCausalLM)
    _assert_matches_transformers(model)


def test_norms_round_as_transformers_in_bfloat16() -> None:
    """In bfloat16 the norm's weight multiplies before the cast back, bit for bit as in transformers."""
    from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm as HFNorm

    hf, ours = HFNorm(64, eps=1e-6), Gemma4RMSNorm(64, 1e-6)
    with torch.no_grad():
        hf.weight.normal_(1.0, 0.3)
        ours.weight.copy_(hf.weight)
        x = torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(2)).bfloat16()
        hf, ours = hf.bfloat16(), ours.bfloat16()
        assert torch.equal(ours(x), hf(x))
        assert not torch.equal(ours(x), RMSNorm.forward(ours, x))  # the other order rounds differently here


def test_torch_operations_match_transformers_too() -> None:
    """Without the fused CPU kernels: SDPA over the cache's narrower views (heads and lanes of the widest row)."""
    with torch_layer_ops():
        _assert_matches_transformers(target())


def test_image_text_checkpoint_names_load(hf_folder: Path, tmp_path: Path) -> None:
    """Released Gemma 4 checkpoints keep the text model under `model.language_model.` beside vision weights, and
    may still carry the K/V projections of sharing layers (transformers ignores them; so do we)."""
    for file in hf_folder.iterdir():
        (tmp_path / file.name).write_bytes(file.read_bytes())
    weights = load_file(str(tmp_path / "model.safetensors"))
    renamed = {name.replace("model.", "model.language_model.", 1): t for name, t in weights.items()}
    renamed["model.vision_tower.patch_embedder.weight"] = torch.zeros(3, 3)
    renamed["model.language_model.layers.5.self_attn.k_proj.weight"] = torch.zeros(32, 64)
    save_file(renamed, str(tmp_path / "model.safetensors"))
    raw = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma4", "text_config": raw}))
    checkpoint = load_hf_dir(tmp_path)
    assert "model.vision_tower.patch_embedder.weight" not in checkpoint.weights
    _assert_matches_transformers(build_model(checkpoint.config, checkpoint.weights))


@pytest.mark.parametrize(
    "overrides",
    [
        # no sharing, no per-layer inputs, separate values everywhere, untied head, equal head sizes
        dict(num_kv_shared_layers=0, hidden_size_per_layer_input=0, attention_k_eq_v=False, tie_word_embeddings=False,
             global_head_dim=16, final_logit_softcapping=None),
        # sharing with plain-width MLPs, values from keys but the same K/V heads as the sliding layers
        dict(use_double_wide_mlp=False, num_global_key_value_heads=None, num_kv_shared_layers=3),
    ],
    ids=["plain", "shared-narrow"],
)
def test_variants_match_transformers(overrides: dict[str, Any]) -> None:
    hf = hf_gemma4(**overrides)
    _assert_matches_transformers(ours_from_hf(hf), hf)


def test_greedy_continuation_equals_transformers_generate() -> None:
    ids = _prompt(3)
    with torch.no_grad():
        reference = hf_gemma4().generate(ids, max_new_tokens=24, do_sample=False, pad_token_id=0)[0, PROMPT_LEN:]
    tokens, _ = run(target(), None, ids[0].tolist(), 24, prefill_chunk=CHUNK)
    assert tokens == reference.tolist()
    assert len(set(tokens)) > 3  # not a degenerate repetition that a wrong model could also produce


def test_missing_tensor_is_a_clear_error(hf_folder: Path, tmp_path: Path) -> None:
    for file in hf_folder.iterdir():
        (tmp_path / file.name).write_bytes(file.read_bytes())
    weights = load_file(str(tmp_path / "model.safetensors"))
    del weights["model.layers.2.per_layer_input_gate.weight"]
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"layers\.2\.per_layer_input_gate"):
        load_hf_dir(tmp_path)


def test_static_forward_matches_the_eager_forward() -> None:
    """The fixed-shape forward (slots scattered into a storage, a bucket of keys read back) over layers of two
    head sizes gives the eager forward's logits."""
    ids = _prompt(4, 24)
    storage = target().new_cache(64)
    with torch.no_grad():
        reference = target()(ids).logits
        first, _ = static_target_forward(target(), storage, ids[:, :16], torch.arange(16)[None],
                                         torch.tensor([0]), torch.ones(16, 16, dtype=torch.bool).tril(),
                                         bucket=32, capture=())
        second, _ = static_target_forward(target(), storage, ids[:, 16:], torch.arange(16, 24)[None],
                                          torch.tensor([16]), torch.ones(8, 8, dtype=torch.bool).tril(),
                                          bucket=32, capture=())
    assert reference is not None
    assert (torch.cat((first, second), dim=1) - reference).abs().max().item() <= 1e-4


# ---- GGUF ----------------------------------------------------------------------------------------------------

_GGUF_LAYER_PARTS = {
    "self_attn.q_proj.weight": "attn_q", "self_attn.k_proj.weight": "attn_k", "self_attn.v_proj.weight": "attn_v",
    "self_attn.o_proj.weight": "attn_output", "self_attn.q_norm.weight": "attn_q_norm",
    "self_attn.k_norm.weight": "attn_k_norm", "input_layernorm.weight": "attn_norm",
    "post_attention_layernorm.weight": "post_attention_norm", "pre_feedforward_layernorm.weight": "ffn_norm",
    "post_feedforward_layernorm.weight": "post_ffw_norm", "mlp.gate_proj.weight": "ffn_gate",
    "mlp.up_proj.weight": "ffn_up", "mlp.down_proj.weight": "ffn_down", "layer_scalar": "layer_output_scale",
    "per_layer_input_gate.weight": "inp_gate", "per_layer_projection.weight": "proj",
    "post_per_layer_input_norm.weight": "post_norm",
}


def _write_gemma4_gguf(path: Path, matrix_type: GGMLQuantizationType | None = None) -> Path:
    """The transformers model as llama.cpp's converter writes a `gemma4` file: per-layer K/V heads and MLP widths
    as arrays, sliding flags per layer, both head widths, and the partial rotation as `rope_freqs` divisors."""
    hf = hf_gemma4()
    config = hf.config
    arch, swa = "gemma4", [kind == S for kind in LAYER_TYPES]
    metadata: dict[str, Any] = {
        f"{arch}.block_count": len(LAYER_TYPES), f"{arch}.embedding_length": 64, f"{arch}.context_length": 256,
        f"{arch}.feed_forward_length": [96] * 5 + [192] * 2, f"{arch}.attention.head_count": 4,
        f"{arch}.attention.head_count_kv": [2 if flag else 1 for flag in swa], f"{arch}.attention.key_length": 32,
        f"{arch}.attention.value_length": 32, f"{arch}.attention.key_length_swa": 16,
        f"{arch}.attention.value_length_swa": 16, f"{arch}.attention.layer_norm_rms_epsilon": config.rms_norm_eps,
        f"{arch}.rope.freq_base": 1_000_000.0, f"{arch}.rope.freq_base_swa": 10_000.0,
        f"{arch}.attention.sliding_window": WINDOW, f"{arch}.attention.sliding_window_pattern": swa,
        f"{arch}.attention.shared_kv_layers": 2, f"{arch}.embedding_length_per_layer_input": 8,
        f"{arch}.final_logit_softcapping": 30.0, f"{arch}.rope.dimension_count": 32,
        f"{arch}.rope.dimension_count_swa": 16, **gguf_tokenizer_metadata(train_byte_level_tokenizer()),
    }
    state = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
    tensors: dict[str, Any] = {
        "token_embd.weight": state["model.embed_tokens.weight"],
        "output_norm.weight": state["model.norm.weight"],
        "per_layer_token_embd.weight": state["model.embed_tokens_per_layer.weight"],
        "per_layer_model_proj.weight": state["model.per_layer_model_projection.weight"],
        "per_layer_proj_norm.weight": state["model.per_layer_projection_norm.weight"],
        # half of the 16 frequency pairs of the 32-wide heads rotate (partial_rotary_factor 0.5)
        "rope_freqs.weight": np.array([1.0] * 8 + [1e30] * 8, dtype=np.float32),
    }
    for i in range(len(LAYER_TYPES)):
        for hf_part, gguf_part in _GGUF_LAYER_PARTS.items():
            if f"model.layers.{i}.{hf_part}" in state:
                tensors[f"blk.{i}.{gguf_part}.weight"] = state[f"model.layers.{i}.{hf_part}"]
    if matrix_type is not None:
        for name, values in list(tensors.items()):
            if values.ndim == 2 and values.shape[1] % 32 == 0:  # rows of whole blocks (the narrow ones stay)
                tensors[name] = quantized(values, matrix_type)
    return write_gguf(path, arch, metadata, tensors)


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DFLASH_NO_CACHE", "1")
        yield _write_gemma4_gguf(tmp_path_factory.mktemp("gguf") / "tiny-gemma4.gguf")


def test_gguf_loads_and_matches_transformers(gguf_path: Path, hf_folder: Path) -> None:
    checkpoint = load_gguf(gguf_path, use_cache=False)
    config, from_hf = checkpoint.config, load_hf_dir(hf_folder).config
    for field in ("layer_types", "head_dim", "global_head_dim", "num_kv_heads", "global_num_kv_heads",
                  "attention_k_eq_v", "num_kv_shared_layers", "double_wide_mlp", "intermediate_size",
                  "hidden_size_per_layer_input", "vocab_size_per_layer_input", "sliding_window", "rope_theta",
                  "rope_local_theta", "embed_scale", "final_logit_softcapping", "fixed_attention_scale",
                  "tie_word_embeddings", "hidden_act", "qk_norm"):
        assert getattr(config, field) == getattr(from_hf, field), field
    assert config.rope_scaling is not None and config.rope_scaling["partial_rotary_factor"] == 0.5
    assert torch.equal(checkpoint.weights["model.layers.3.layer_scalar"], torch.tensor([0.9]))
    _assert_matches_transformers(build_model(config, checkpoint.weights))


def test_gguf_cache_keeps_the_gemma4_settings(gguf_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DFLASH_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("DFLASH_NO_CACHE")
    monkeypatch.setattr(gguf_loader, "CACHE_MIN_SECONDS", 0.0)
    first = load_gguf(gguf_path)
    assert any(tmp_path.rglob("*.safetensors"))
    monkeypatch.setattr(gguf_loader, "GGUFFile", None)  # a second parse would fail
    second = load_gguf(gguf_path)
    assert second.config == first.config and second.config.rope_scaling == first.config.rope_scaling
    _assert_matches_transformers(build_model(second.config, second.weights))


def test_quantized_gguf_runs_dense_and_quantized_cpu_weights_decline(tmp_path: Path) -> None:
    """A Q8_0 file: `auto` settles on dense weights with the reason, `quantized` asked for is an error."""
    path = _write_gemma4_gguf(tmp_path / "q8.gguf", GGMLQuantizationType.Q8_0)
    choice = choose_weights("auto", path, torch.device("cpu"), torch.float32)
    assert choice.kind == "dense" and "Gemma 4" in choice.reason
    with pytest.raises(ModelLoadError, match="Gemma 4"):
        choose_weights("quantized", path, torch.device("cpu"), torch.float32)
    checkpoint = load_gguf(path, use_cache=False)
    hf_q = hf_gemma4().state_dict()["model.layers.4.self_attn.q_proj.weight"]  # [128, 64]
    expected = dequantize(quantize(hf_q.numpy(), GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0)
    ours_q = checkpoint.weights["model.layers.4.self_attn.q_proj.weight"]
    assert torch.equal(ours_q, torch.from_numpy(expected).reshape(ours_q.shape)) and not torch.equal(ours_q, hf_q)
    # rounding changes this tiny random model's logits a lot: compare with transformers given the same weights
    hf = copy.deepcopy(hf_gemma4())
    hf.load_state_dict(checkpoint.weights, strict=False)
    _assert_matches_transformers(build_model(checkpoint.config, checkpoint.weights), hf)


def test_gguf_gemma4_tokenizer_follows_its_listed_merges() -> None:
    """llama.cpp writes Gemma 4's vocabulary as tokenizer model "gemma4": SentencePiece-style pieces with their
    merges listed. The listed order wins over the scores ("b a" before "a b" though "ab" scores higher)."""
    pieces = ["\u2581", "a", "b", "ab", "ba"]
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    md = {
        "tokenizer.ggml.model": "gemma4", "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3, 3, 3, 2] + [6] * 256 + [1] * len(pieces),
        "tokenizer.ggml.scores": [0.0] * 260 + [-1.0, -1.0, -1.0, 5.0, -3.0],
        "tokenizer.ggml.merges": ["b a", "a b"], "tokenizer.ggml.bos_token_id": 2,
        "tokenizer.ggml.eos_token_id": 1, "tokenizer.ggml.add_space_prefix": False,
    }
    tok = Tokenizer.from_gguf_metadata(md, source="gemma4")
    assert tok.add_bos and tok.bos_token_id == 2
    assert tok.encode("aba") == [tokens.index("a"), tokens.index("ba")]
    assert tok.decode(tok.encode("ab ba")) == "ab ba"


def test_batched_step_equals_the_eager_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    """The offline batched step (left-padded rows, key buckets, slots written through `SlotWriter`) gives the eager
    forward's logits."""
    monkeypatch.setattr(batched_step, "STEP_BUCKET", 8)  # the steps cross several buckets
    prompts = random_prompts(3, target().config.vocab_size, seed=3, lengths=(5, 19, 11))
    new = torch.randint(0, target().config.vocab_size, (3, 14), generator=torch.Generator().manual_seed(4))
    decoder = BatchedDecoder(target(), 3, 19 + 14)
    stepped, eager = step_logits(target(), decoder, prompts, new)
    for a, b in zip(stepped, eager, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


# ---- fast paths that cannot run it ---------------------------------------------------------------------------


def test_fast_paths_decline_gemma4(monkeypatch: pytest.MonkeyPatch, hf_folder: Path) -> None:
    monkeypatch.setattr(fused_layers, "triton_available", lambda: True)
    assert fused_layers.supports_fused_layers(ours_from_hf(hf_tiny("qwen3")))  # the dense family is fused
    assert not fused_layers.supports_fused_layers(target())
    assert not target().capturable
    cuda = torch.device("cuda")
    options = resolve_options(EngineOptions(), device=cuda, has_drafter=True, tensor_parallel=False,
                              capturable=target().capturable)
    assert not options.cuda_graphs
    with pytest.raises(ModelLoadError, match="Gemma 4"):
        shard_config(target().config, 2)
    quantized = QuantizedCheckpoint(config=target().config, weights={}, tokenizer=None, source=hf_folder)
    with pytest.raises(ModelLoadError, match="Gemma 4"):
        build_quantized_model(quantized)


# ---- speculative decoding --------------------------------------------------------------------------------------


def _drafter() -> DFlashDrafter:
    return tiny_drafter(target().config.vocab_size, len(LAYER_TYPES), [1, 5])


def test_linear_and_ddtree_greedy_equal_plain_greedy(monkeypatch: pytest.MonkeyPatch) -> None:
    check_linear_and_ddtree_equal_plain(monkeypatch, target(), _drafter(), CHUNK)


def test_batched_core_gives_each_request_its_plain_greedy_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plain, linear and DDTree requests decoding together in the packed batch (whose pool rows hold both head
    sizes) each give what plain decoding gives alone, with a mostly right drafter."""
    core = check_batched_core_equals_plain(monkeypatch, target(), _drafter(), CHUNK)
    keys = core.target_pool.keys  # [layers, kv_heads, slots, head_dim]: no rows for the 2 sharing layers
    assert (keys.shape[0], keys.shape[1], keys.shape[3]) == (5, 2, 32)  # the most K/V heads, the widest heads


@pytest.mark.parametrize("max_batch", [1, 2])
def test_engine_serves_the_hf_folder_with_its_greedy_tokens(hf_folder: Path, max_batch: int) -> None:
    """Through `load_engine`, one at a time and in the engine loop; a second request extending the first reuses its
    cached prefix (rows of both head shapes) and still gives its own greedy tokens."""
    options = EngineOptions(max_batch=max_batch, prefill_chunk=CHUNK, prefix_cache_mb=8.0)
    engine = load_engine(str(hf_folder), draft="none", options=options)
    try:
        assert engine.batched == (max_batch > 1) and isinstance(engine.target, Gemma4ForCausalLM)
        prompt = _prompt(6, 21)[0].tolist()
        result = engine.generate(GenerationRequest(prompt_ids=prompt, max_new_tokens=16, ignore_eos=True))
        assert result.token_ids == run(target(), None, prompt, 16, prefill_chunk=CHUNK)[0]
        longer = prompt + result.token_ids + _prompt(7, 19)[0].tolist()
        again = engine.generate(GenerationRequest(prompt_ids=longer, max_new_tokens=12, ignore_eos=True))
        assert again.token_ids == run(target(), None, longer, 12, prefill_chunk=CHUNK)[0]
        assert engine.prefix_cache is not None and engine.prefix_cache.stats().reused_tokens > 0
    finally:
        engine.close()


@pytest.mark.slow
def test_sampling_keeps_the_target_distribution(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sampled linear and DDTree requests in a batch (soft-capped logits, K/V-sharing layers) keep plain
    sampling's per-position distributions."""
    hf = hf_gemma4(vocab_size=SAMPLED_VOCAB, tie_word_embeddings=False)
    with torch.no_grad():
        hf.lm_head.weight.mul_(3.0)  # next-token distributions far from uniform
    check_sampling_keeps_the_distribution(monkeypatch, ours_from_hf(hf), [1, 5])
