"""Qwen3-Next (hybrid layers plus mixture-of-experts MLPs), loaded from a transformers checkpoint folder, against
transformers: logits, cached prefill, greedy decoding, and lossless linear DFlash."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash.config import FULL_ATTENTION, LINEAR_ATTENTION
from dflash.errors import ModelLoadError
from dflash.models.checkpoint import Checkpoint
from dflash.models.hf_loader import load_hf_dir
from dflash.models.model import CausalLM
from dflash.models.registry import build_model
from tests.hybrid_models import TINY_NEXT, hf_tiny_next
from tests.loading_helpers import train_byte_level_tokenizer
from tests.spec_helpers import one_torch_thread, random_prompts, run
from tests.test_hybrid_spec import _drafter

transformers = pytest.importorskip("transformers")
_threads = one_torch_thread

TOLERANCE = 1e-4  # float32 logits
VOCAB = TINY_NEXT["vocab_size"]


def _save(hf: Any, path: Path) -> None:
    hf.save_pretrained(str(path))
    train_byte_level_tokenizer().save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("qwen3_next")
    _save(hf_tiny_next(), path)
    return path


@pytest.fixture(scope="module")
def pair(folder: Path) -> tuple[Any, CausalLM]:
    checkpoint = load_hf_dir(folder)
    return hf_tiny_next(), build_model(checkpoint.config, checkpoint.weights)


def test_config_from_checkpoint(folder: Path) -> None:
    checkpoint: Checkpoint = load_hf_dir(folder)
    config = checkpoint.config
    assert config.architecture == "qwen3_next" and config.is_hybrid and config.norm_adds_one
    assert config.layer_types == (LINEAR_ATTENTION, FULL_ATTENTION, LINEAR_ATTENTION, LINEAR_ATTENTION)
    # layer 2 is in mlp_only_layers
    assert [config.sparse_layer(i) for i in range(config.num_layers)] == [True, True, False, True]
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (6, 2, 32)
    assert config.shared_expert_intermediate_size == 48 and config.norm_topk_prob and config.is_moe
    # the files store experts one by one: the checkpoint holds them stacked per projection, as for Qwen3-MoE
    assert "model.layers.0.mlp.experts.5.down_proj.weight" not in checkpoint.weights
    assert tuple(checkpoint.weights["model.layers.0.mlp.experts.down_proj"].shape) == (6, config.hidden_size, 32)
    # the DeltaNet projections stay fused per key head until the model splits them
    assert "model.layers.0.linear_attn.in_proj_qkvz.weight" in checkpoint.weights


def test_logits_match_transformers(pair: tuple[Any, CausalLM]) -> None:
    hf, ours = pair
    ids = torch.randint(0, VOCAB, (1, 130), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(ids).logits
    torch.testing.assert_close(ours(ids).logits, expected, atol=TOLERANCE, rtol=0)
    cache = ours.new_cache(140)
    chunks = [ours(ids[:, lo : lo + 50], cache=cache).logits for lo in range(0, 130, 50)]
    torch.testing.assert_close(torch.cat(chunks, dim=1), expected, atol=TOLERANCE, rtol=0)


def test_greedy_matches_transformers_generate(pair: tuple[Any, CausalLM]) -> None:
    hf, ours = pair
    prompt = torch.randint(0, VOCAB, (1, 21), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = hf.generate(
            prompt, max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0, min_new_tokens=20
        )[0, 21:].tolist()
    tokens, _ = run(ours, None, prompt[0].tolist(), 20, prefill_chunk=8)
    assert tokens == expected


def test_linear_dflash_is_lossless(pair: tuple[Any, CausalLM]) -> None:
    _, ours = pair
    drafter = _drafter()
    for prompt in random_prompts(2, VOCAB, seed=4, lengths=(11, 40)):
        plain, _ = run(ours, None, prompt, 24)
        spec, stats = run(ours, drafter, prompt, 24)
        assert spec == plain and stats.rounds > 0


def test_missing_expert_is_a_load_error(folder: Path, tmp_path: Path) -> None:
    for file in folder.iterdir():
        (tmp_path / file.name).write_bytes(file.read_bytes())
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["model.layers.3.mlp.experts.4.up_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"experts\.4\.up_proj"):
        load_hf_dir(tmp_path)
