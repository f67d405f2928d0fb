"""Qwen3-Next (hybrid layers plus mixture-of-experts MLPs), loaded from a transformers checkpoint folder, against
transformers: logits, cached prefill, greedy decoding, and lossless linear DFlash."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash.config import FULL_ATTENTION, LINEAR_ATTENTION, ModelConfig
from dflash.engine.engine import EngineOptions, resolve_options
from dflash.errors import ModelLoadError
from dflash.models.checkpoint import Checkpoint
from dflash.models.hf_loader import load_hf_dir
from dflash.models.model import CausalLM
from dflash.models.moe import SharedExpertMoeBlock, SparseMoeBlock
from dflash.models.registry import build_model
from dflash.parallel.sharding import shard_config
from tests.family_checks import SAMPLED_VOCAB, check_sampling_keeps_the_distribution
from tests.hybrid_models import TINY_NEXT, hf_tiny_next, ours_from_hf_hybrid
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


def test_ddtree_is_lossless(pair: tuple[Any, CausalLM], monkeypatch: pytest.MonkeyPatch) -> None:
    """Trees over the recurrent layers (rows from their parents' states, the accepted path replayed): the plain
    greedy tokens with a random drafter and with a mostly right one."""
    from tests.family_checks import check_linear_and_ddtree_equal_plain

    check_linear_and_ddtree_equal_plain(monkeypatch, pair[1], _drafter(), 16)


def test_batched_core_with_trees_is_lossless(pair: tuple[Any, CausalLM], monkeypatch: pytest.MonkeyPatch) -> None:
    """Plain, linear and DDTree requests decoding together in the batched core, each tree over its own request's
    recurrent state, with a mostly right drafter: every request's plain greedy tokens."""
    from tests.family_checks import check_batched_core_equals_plain

    check_batched_core_equals_plain(monkeypatch, pair[1], _drafter(), 16)


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


# ---- the mixture of experts shared with Qwen3-MoE ---------------------------------------------------------------


def test_routing_and_shared_expert_follow_transformers(pair: tuple[Any, CausalLM]) -> None:
    """The block reuses Qwen3-MoE's router: same experts and weights as transformers' Qwen3-Next router, token by
    token; with the gated shared expert, the block's output matches too."""
    hf, ours = pair
    hf_block, block = hf.model.layers[0].mlp, ours.layers[0].mlp
    assert isinstance(block, SharedExpertMoeBlock) and isinstance(block, SparseMoeBlock)
    x = torch.randn(40, TINY_NEXT["hidden_size"], generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        _, hf_weights, hf_chosen = hf_block.gate(x)
        chosen, weights = block.route(x)
        assert torch.equal(chosen, hf_chosen)
        torch.testing.assert_close(weights, hf_weights, atol=1e-6, rtol=0)
        torch.testing.assert_close(block(x[None]), hf_block(x[None]), atol=1e-4, rtol=0)
        # what the block adds to the routed experts is transformers' gated shared expert
        shared = block(x[None])[0] - block.experts(x, chosen, weights)
        hf_shared = torch.sigmoid(hf_block.shared_expert_gate(x)) * hf_block.shared_expert(x)
        assert hf_shared.abs().max().item() > 1e-3
        torch.testing.assert_close(shared, hf_shared, atol=1e-5, rtol=0)


def test_fused_expert_parameters_load_like_per_expert_files(pair: tuple[Any, CausalLM]) -> None:
    """transformers' in-memory names (`experts.gate_up_proj` [experts, 2 * width, hidden]) go through the same
    conversion as Qwen3-MoE's."""
    hf, _ = pair
    state = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    ours = build_model(ModelConfig.from_hf(hf.config.to_dict()), state)
    ids = torch.randint(0, VOCAB, (1, 30), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, hf(ids).logits, atol=TOLERANCE, rtol=0)


def test_absent_expert_fields_take_transformers_defaults() -> None:
    """A Qwen3-Next config.json may leave out the expert fields (its configuration class has defaults); Qwen3-MoE's
    must state the expert width."""
    raw = transformers.Qwen3NextConfig(**TINY_NEXT).to_dict()
    for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
                "norm_topk_prob"):
        raw.pop(key)
    defaults = transformers.Qwen3NextConfig()
    config = ModelConfig.from_hf(raw)
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (
        defaults.num_experts, defaults.num_experts_per_tok, defaults.moe_intermediate_size
    )
    assert config.shared_expert_intermediate_size == defaults.shared_expert_intermediate_size
    assert config.norm_topk_prob == defaults.norm_topk_prob
    dense = ModelConfig.from_hf({**raw, "num_experts": 0})
    assert not dense.is_moe and not any(dense.sparse_layer(i) for i in range(dense.num_layers))
    moe = {**raw, "model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2}
    with pytest.raises(ModelLoadError, match="moe_intermediate_size"):
        ModelConfig.from_hf(moe)


def test_guards_of_both_families_apply(pair: tuple[Any, CausalLM]) -> None:
    """Hybrid and mixture of experts at once: no CUDA graphs, no tensor parallelism."""
    _, ours = pair
    assert not ours.capturable and ours.config.is_moe and ours.config.is_hybrid
    options = resolve_options(EngineOptions(max_batch=4), device=torch.device("cuda"), has_drafter=True,
                              tensor_parallel=False, capturable=ours.capturable, hybrid=ours.config.is_hybrid)
    assert not options.cuda_graphs and options.spec == "ddtree"  # the batched step verifies a hybrid's trees
    with pytest.raises(ModelLoadError, match="tensor-parallel"):
        shard_config(ours.config, 2)


@pytest.mark.slow
def test_sampling_keeps_the_target_distribution(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sampled linear and DDTree requests in a batch (recurrent states rolled back, experts shared) keep plain
    sampling's per-position distributions."""
    hf = hf_tiny_next(seed=3, vocab_size=SAMPLED_VOCAB)
    with torch.no_grad():
        hf.lm_head.weight.mul_(3.0)  # next-token distributions far from uniform
    check_sampling_keeps_the_distribution(monkeypatch, ours_from_hf_hybrid(hf), [1, 3])
