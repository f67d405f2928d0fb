"""Qwen3.5 hybrid models (Gated DeltaNet + gated attention) against transformers, and their recurrent cache state."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from dflash.config import FULL_ATTENTION, LINEAR_ATTENTION, ModelConfig
from dflash.errors import GenerationError, ModelLoadError
from dflash.generation.autoregressive import decode_autoregressive
from dflash.generation.output import OutputSink
from dflash.generation.request import GenerationRequest
from dflash.generation.sampling import SamplingParams
from dflash.generation.selection import TokenChooser
from dflash.models.delta_rule import chunked_delta_rule, recurrent_delta_rule
from dflash.models.hf_loader import load_hf_dir
from dflash.models.model import CausalLM
from dflash.models.registry import build_model
from tests.hybrid_models import TINY_HYBRID, hf_tiny_hybrid, ours_from_hf_hybrid
from tests.loading_helpers import train_byte_level_tokenizer
from tests.spec_helpers import one_torch_thread

transformers = pytest.importorskip("transformers")
_threads = one_torch_thread

TOLERANCE = 1e-4  # float32 logits


@pytest.fixture(scope="module")
def pair() -> tuple[Any, CausalLM]:
    hf = hf_tiny_hybrid()
    return hf, ours_from_hf_hybrid(hf)


def _prompt(length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, TINY_HYBRID["vocab_size"], (1, length), generator=torch.Generator().manual_seed(seed))


def test_config_from_hf() -> None:
    raw = hf_tiny_hybrid().config.to_dict()
    config = ModelConfig.from_hf(raw)
    assert config.architecture == "qwen3_5" and config.is_hybrid and config.norm_adds_one and config.qk_norm
    assert config.layer_types == (LINEAR_ATTENTION, LINEAR_ATTENTION, FULL_ATTENTION, LINEAR_ATTENTION)
    assert (config.linear_num_key_heads, config.linear_num_value_heads) == (2, 4)
    assert (config.linear_key_head_dim, config.linear_value_head_dim, config.linear_conv_kernel) == (8, 12, 4)
    assert config.partial_rotary_factor == 0.25 and config.rotary_dim == 4 and config.attention_output_gate
    # the multimodal checkpoint's config nests the text model; without layer_types every 4th layer is full
    nested = {k: v for k, v in raw.items() if k != "layer_types"}
    outer = ModelConfig.from_hf({"model_type": "qwen3_5", "text_config": {**nested, "num_hidden_layers": 8}})
    assert outer.layer_types == ((LINEAR_ATTENTION,) * 3 + (FULL_ATTENTION,)) * 2
    # the other families keep their (non-hybrid) configuration
    llama = ModelConfig.from_hf({**raw, "model_type": "llama", "layer_types": None})
    assert not llama.is_hybrid and llama.rotary_dim == llama.head_dim and not llama.norm_adds_one


def test_bad_hybrid_config_is_a_load_error() -> None:
    raw = hf_tiny_hybrid().config.to_dict()
    with pytest.raises(ModelLoadError, match="value heads do not divide"):
        ModelConfig.from_hf({**raw, "linear_num_value_heads": 3})
    with pytest.raises(ModelLoadError, match="unsupported layer type 'mamba'"):
        ModelConfig.from_hf({**raw, "layer_types": ["mamba"] * 4})
    with pytest.raises(ModelLoadError, match="no linear-attention layers"):
        ModelConfig.from_hf({**raw, "model_type": "qwen3"})
    with pytest.raises(ModelLoadError, match="in_proj_qkv"):
        weights = {k: v for k, v in hf_tiny_hybrid().state_dict().items() if "layers.1.linear_attn.in_proj_qkv" not in k}
        build_model(ModelConfig.from_hf(raw), weights)


def test_delta_rule_forms_agree_with_transformers() -> None:
    """Our recurrent and chunked forms against each other and against transformers' reference chunked rule, over
    several chunks with a ragged last one and a non-zero initial state."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    g = torch.Generator().manual_seed(0)
    batch, heads, seq, key_dim, value_dim = 1, 3, 150, 8, 6
    q, k = (torch.randn(batch, heads, seq, key_dim, generator=g) for _ in range(2))
    v = torch.randn(batch, heads, seq, value_dim, generator=g)
    decay, beta = -torch.rand(batch, heads, seq, generator=g), torch.rand(batch, heads, seq, generator=g)
    state = torch.randn(batch, heads, key_dim, value_dim, generator=g)
    k = torch.nn.functional.normalize(k, dim=-1)
    out_r, state_r = recurrent_delta_rule(q, k, v, decay, beta, state)
    out_c, state_c = chunked_delta_rule(q, k, v, decay, beta, state)
    torch.testing.assert_close(out_c, out_r, atol=1e-4, rtol=0)
    torch.testing.assert_close(state_c, state_r, atol=1e-5, rtol=0)
    seq_first = [x.transpose(1, 2) for x in (q * key_dim**0.5, k, v, decay, beta)]  # theirs scales q itself
    out_t, state_t = torch_chunk_gated_delta_rule(
        *seq_first[:3], g=seq_first[3], beta=seq_first[4], initial_state=state, output_final_state=True
    )
    torch.testing.assert_close(out_c, out_t.transpose(1, 2), atol=1e-5, rtol=0)
    torch.testing.assert_close(state_c, state_t, atol=1e-5, rtol=0)


def test_logits_match_transformers(pair: tuple[Any, CausalLM]) -> None:
    hf, ours = pair
    ids = _prompt(150)  # longer than one delta-rule chunk (64)
    with torch.no_grad():
        expected = hf(ids).logits
    torch.testing.assert_close(ours(ids).logits, expected, atol=TOLERANCE, rtol=0)


@pytest.mark.parametrize("chunk", [1, 7, 40, 150])
def test_chunked_prefill_through_cache_equals_one_shot(pair: tuple[Any, CausalLM], chunk: int) -> None:
    """Chunks of 1 and 7 rows take the recurrent form, 40 and 150 the chunked one; the cache carries the
    convolution window and state across chunk boundaries."""
    hf, ours = pair
    ids = _prompt(150, seed=2)
    with torch.no_grad():
        expected = hf(ids).logits
    cache = ours.new_cache(160)
    parts = [ours(ids[:, lo : lo + chunk], cache=cache).logits for lo in range(0, ids.shape[1], chunk)]
    assert cache.length == 150 and cache.recurrent is not None and cache.recurrent.length == 150
    torch.testing.assert_close(torch.cat(parts, dim=1), expected, atol=TOLERANCE, rtol=0)


def test_cached_steps_match_transformers_cache(pair: tuple[Any, CausalLM]) -> None:
    """Prefill, then one token at a time, both through our cache and transformers' (its recurrent decode path)."""
    hf, ours = pair
    ids = _prompt(90, seed=3)
    cache = ours.new_cache(100)
    with torch.no_grad():
        theirs = hf(ids[:, :70], use_cache=True)
        torch.testing.assert_close(ours(ids[:, :70], cache=cache).logits, theirs.logits, atol=TOLERANCE, rtol=0)
        past = theirs.past_key_values
        for t in range(70, 90):
            theirs = hf(ids[:, t : t + 1], past_key_values=past, use_cache=True)
            past = theirs.past_key_values
            mine = ours(ids[:, t : t + 1], cache=cache).logits
            torch.testing.assert_close(mine, theirs.logits, atol=TOLERANCE, rtol=0)


def _save_checkpoint(hf: Any, path: Path, *, multimodal_names: bool = False) -> None:
    hf.save_pretrained(str(path))
    train_byte_level_tokenizer().save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    if multimodal_names:  # Qwen3.5 checkpoints keep the text model under model.language_model.
        from safetensors.torch import load_file, save_file

        file = path / "model.safetensors"
        tensors = load_file(str(file))
        renamed = {k.replace("model.", "model.language_model.", 1): v for k, v in tensors.items()}
        renamed["model.visual.patch_embed.proj.weight"] = torch.zeros(2, 2)
        save_file(renamed, str(file), metadata={"format": "pt"})


def _greedy(model: CausalLM, prompt: list[int], max_new: int, prefill_chunk: int = 16) -> list[int]:
    sampling = SamplingParams()
    request = GenerationRequest(prompt_ids=prompt, max_new_tokens=max_new, sampling=sampling)
    sink = OutputSink(lambda ids: "", eos_ids=(), max_new_tokens=max_new)
    chooser = TokenChooser(sampling, eos_ids=(), min_tokens=0, vocab_size=model.config.vocab_size, device="cpu")
    decode_autoregressive(model, request, sink, chooser, prefill_chunk=prefill_chunk)
    return sink.token_ids


@pytest.mark.parametrize("multimodal_names", [False, True])
def test_loaded_checkpoint_decodes_like_transformers_generate(tmp_path: Path, multimodal_names: bool) -> None:
    hf = hf_tiny_hybrid(seed=4)
    _save_checkpoint(hf, tmp_path, multimodal_names=multimodal_names)
    checkpoint = load_hf_dir(tmp_path)
    assert checkpoint.tokenizer is not None and checkpoint.config.architecture == "qwen3_5"
    model = build_model(checkpoint.config, checkpoint.weights)
    prompt = _prompt(37, seed=5)
    with torch.no_grad():
        expected = hf.generate(
            prompt, max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0, min_new_tokens=24
        )[0, 37:].tolist()
    assert _greedy(model, prompt[0].tolist(), 24) == expected


def test_crop_restores_state_at_every_accepted_length(pair: tuple[Any, CausalLM]) -> None:
    """After a 9-row verification-sized forward, cropping to any length inside it leaves the same state as a cache
    that only ever saw that many tokens: the next forward's logits agree."""
    _, ours = pair
    ids = _prompt(60, seed=6)
    for keep in (0, 1, 4, 8, 9):
        cache = ours.new_cache(80)
        ours(ids[:, :40], cache=cache)
        ours(ids[:, 40:49], cache=cache)  # 9 rows, the last ones "rejected"
        cache.crop(40 + keep)
        fresh = ours.new_cache(80)
        ours(ids[:, : 40 + keep], cache=fresh)
        after = ids[:, 49:52]  # different tokens than the rejected ones
        torch.testing.assert_close(ours(after, cache=cache).logits, ours(after, cache=fresh).logits, atol=1e-5, rtol=0)


def test_crop_before_last_forward_is_refused(pair: tuple[Any, CausalLM]) -> None:
    _, ours = pair
    ids = _prompt(50, seed=7)
    cache = ours.new_cache(60)
    ours(ids[:, :30], cache=cache)
    ours(ids[:, 30:34], cache=cache)
    with pytest.raises(GenerationError, match="roll back only to 30"):
        cache.crop(29)
    with pytest.raises(GenerationError, match="cannot keep"):  # a path of the last forward's rows only
        cache.compact(30, torch.tensor([29, 31]))
    cache.crop(0)  # back to empty: the state starts over
    assert cache.recurrent is not None and cache.recurrent.length == 0
    torch.testing.assert_close(ours(ids[:, :5], cache=cache).logits, ours(ids[:, :5]).logits, atol=1e-6, rtol=0)


def test_masks_and_foreign_caches_are_refused(pair: tuple[Any, CausalLM]) -> None:
    _, ours = pair
    ids = _prompt(4)
    with pytest.raises(GenerationError, match="no attention mask"):
        ours(ids, attn_mask=torch.ones(1, 4, 4, dtype=torch.bool))
    with pytest.raises(GenerationError, match="tree verification of a hybrid model needs its cache"):
        ours(ids, tree_mask=torch.ones(4, 4, dtype=torch.bool).tril())
    from dflash.kv.cache import KVCache

    with pytest.raises(GenerationError, match="recurrent state"):
        ours(ids, cache=KVCache(1, 2, 16, 8))
