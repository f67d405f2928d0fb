"""Qwen3.5-MoE (hybrid layers, every MLP a mixture of experts with a gated shared expert), loaded from a
transformers checkpoint folder, against transformers: logits, cached prefill and steps, greedy decoding, lossless
linear DFlash alone and in the batched core, and the guards of both hybrid and mixture-of-experts models."""

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
from dflash.models.hf_loader import load_hf_dir
from dflash.models.model import CausalLM
from dflash.models.moe import SharedExpertMoeBlock
from dflash.models.qwen3_5_moe import Qwen35MoeForCausalLM
from dflash.models.registry import build_model
from dflash.models.weight_choice import choose_weights
from dflash.parallel.sharding import shard_config
from tests.batch_helpers import drain, make_core, make_sequence
from tests.family_checks import SAMPLED_VOCAB, check_sampling_keeps_the_distribution
from tests.hybrid_models import TINY_35_MOE, hf_tiny_35_moe, ours_from_hf_hybrid
from tests.loading_helpers import train_byte_level_tokenizer
from tests.spec_helpers import one_torch_thread, random_prompts, run
from tests.test_batch_core import _install_oracle as install_batch_oracle
from tests.test_ddtree_decode import install_oracle
from tests.test_hybrid_spec import _drafter

transformers = pytest.importorskip("transformers")
_threads = one_torch_thread

TOLERANCE = 1e-4  # float32 logits
VOCAB = TINY_35_MOE["vocab_size"]
CHUNK = 32  # prefill chunk: the prompts below span several


def _save(hf: Any, path: Path, *, multimodal: bool = False) -> None:
    """transformers' save_pretrained (one tensor per expert), plus a tokenizer. `multimodal`: laid out as the hub's
    image-text checkpoints are (config under `text_config`, the text model under `model.language_model.`)."""
    hf.save_pretrained(str(path))
    train_byte_level_tokenizer().save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    if multimodal:
        outer = transformers.Qwen3_5MoeConfig(text_config=hf.config.to_dict()).to_dict()
        (path / "config.json").write_text(json.dumps(outer))
        tensors = load_file(str(path / "model.safetensors"))
        renamed = {k.replace("model.", "model.language_model.", 1): v for k, v in tensors.items()}
        renamed["model.visual.patch_embed.proj.weight"] = torch.zeros(2, 2)
        save_file(renamed, str(path / "model.safetensors"), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("qwen3_5_moe")
    _save(hf_tiny_35_moe(), path)
    return path


@pytest.fixture(scope="module")
def pair(folder: Path) -> tuple[Any, CausalLM]:
    checkpoint = load_hf_dir(folder)
    return hf_tiny_35_moe(), build_model(checkpoint.config, checkpoint.weights)


def _prompt(length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("multimodal", [False, True])
def test_config_and_weights_from_checkpoint(tmp_path: Path, multimodal: bool) -> None:
    _save(hf_tiny_35_moe(), tmp_path, multimodal=multimodal)
    checkpoint = load_hf_dir(tmp_path)
    config = checkpoint.config
    assert config.architecture == "qwen3_5_moe" and config.is_hybrid and config.norm_adds_one and config.qk_norm
    assert config.layer_types == (LINEAR_ATTENTION, FULL_ATTENTION, LINEAR_ATTENTION, LINEAR_ATTENTION)
    assert all(config.sparse_layer(i) for i in range(config.num_layers))  # no dense MLP anywhere
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (6, 2, 32)
    assert config.shared_expert_intermediate_size == 48 and config.norm_topk_prob
    assert config.intermediate_size == 0 and config.rotary_dim == 4  # partial_rotary_factor 0.25 of 16
    # one tensor per expert in the files; stacked per projection in the checkpoint, as for Qwen3-MoE
    assert "model.layers.0.mlp.experts.5.down_proj.weight" not in checkpoint.weights
    assert tuple(checkpoint.weights["model.layers.3.mlp.experts.gate_proj"].shape) == (6, 32, config.hidden_size)
    assert "model.visual.patch_embed.proj.weight" not in checkpoint.weights
    model = build_model(config, checkpoint.weights)
    assert isinstance(model, Qwen35MoeForCausalLM)
    assert all(isinstance(layer.mlp, SharedExpertMoeBlock) for layer in model.layers)


def test_logits_match_transformers(pair: tuple[Any, CausalLM]) -> None:
    """One forward, and the same prompt (longer than a delta-rule chunk of 64) in prefill chunks through the cache."""
    hf, ours = pair
    ids = _prompt(130, seed=1)
    with torch.no_grad():
        expected = hf(ids).logits
    torch.testing.assert_close(ours(ids).logits, expected, atol=TOLERANCE, rtol=0)
    cache = ours.new_cache(140)
    chunks = [ours(ids[:, lo : lo + 50], cache=cache).logits for lo in range(0, 130, 50)]
    torch.testing.assert_close(torch.cat(chunks, dim=1), expected, atol=TOLERANCE, rtol=0)


def test_cached_steps_match_transformers_cache(pair: tuple[Any, CausalLM]) -> None:
    """Prefill, then one token at a time, through our cache and transformers' (its recurrent decode path)."""
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
            torch.testing.assert_close(ours(ids[:, t : t + 1], cache=cache).logits, theirs.logits,
                                       atol=TOLERANCE, rtol=0)


def test_greedy_matches_transformers_generate(pair: tuple[Any, CausalLM]) -> None:
    hf, ours = pair
    prompt = _prompt(45, seed=2)
    with torch.no_grad():
        expected = hf.generate(
            prompt, max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0, min_new_tokens=20
        )[0, 45:].tolist()
    tokens, _ = run(ours, None, prompt[0].tolist(), 20, prefill_chunk=CHUNK)
    assert tokens == expected


def test_block_follows_transformers(pair: tuple[Any, CausalLM]) -> None:
    """Router (always rescaled) and gated shared expert: same experts, weights and output as transformers' block."""
    hf, ours = pair
    hf_block, block = hf.model.layers[1].mlp, ours.layers[1].mlp
    assert isinstance(block, SharedExpertMoeBlock)
    x = torch.randn(40, TINY_35_MOE["hidden_size"], generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        _, hf_weights, hf_chosen = hf_block.gate(x)
        chosen, weights = block.route(x)
        assert torch.equal(chosen, hf_chosen)
        torch.testing.assert_close(weights, hf_weights, atol=1e-6, rtol=0)
        torch.testing.assert_close(block(x[None]), hf_block(x[None]), atol=1e-4, rtol=0)


def test_fused_expert_parameters_load_like_per_expert_files(pair: tuple[Any, CausalLM]) -> None:
    """transformers' in-memory names (`experts.gate_up_proj` [experts, 2 * width, hidden]) load as well."""
    hf, _ = pair
    state = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    ours = build_model(ModelConfig.from_hf(hf.config.to_dict()), state)
    ids = _prompt(30, seed=6)
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, hf(ids).logits, atol=TOLERANCE, rtol=0)


def test_ddtree_is_lossless(pair: tuple[Any, CausalLM], monkeypatch: pytest.MonkeyPatch) -> None:
    """Trees over the recurrent layers (rows from their parents' states, the accepted path replayed): the plain
    greedy tokens with a random drafter and with a mostly right one."""
    from tests.family_checks import check_linear_and_ddtree_equal_plain

    check_linear_and_ddtree_equal_plain(monkeypatch, pair[1], _drafter(), CHUNK)


def test_linear_dflash_is_lossless(pair: tuple[Any, CausalLM], monkeypatch: pytest.MonkeyPatch) -> None:
    """A random drafter (drafts mostly rejected) and a mostly right one (several accepted per round): both give
    the plain greedy tokens, so rejected drafts leave no trace in the recurrent state."""
    _, ours = pair
    drafter = _drafter()
    for prompt in random_prompts(2, VOCAB, seed=4, lengths=(11, 70)):
        plain, _ = run(ours, None, prompt, 24, prefill_chunk=CHUNK)
        spec, stats = run(ours, drafter, prompt, 24, prefill_chunk=CHUNK)
        assert spec == plain and stats.rounds > 0
        with monkeypatch.context() as mp:
            install_oracle(mp, drafter, prompt + run(ours, None, prompt, 24 + 6, prefill_chunk=CHUNK)[0])
            oracle, oracle_stats = run(ours, drafter, prompt, 24, prefill_chunk=CHUNK)
        assert oracle == plain and oracle_stats.acceptance_length > 2.0


def test_batched_core_gives_each_request_its_plain_greedy_tokens(
    pair: tuple[Any, CausalLM], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Plain, linear and DDTree requests decoding together (prefill chunks beside verification blocks and trees,
    each request with its own recurrent state, rows sharing each expert's product), with a mostly right drafter."""
    _, ours = pair
    drafter = _drafter()
    prompts = random_prompts(4, VOCAB, seed=12, lengths=(12, 40, 75, 23))
    references = [run(ours, None, p, 20, prefill_chunk=CHUNK)[0] for p in prompts]
    core = make_core(ours, drafter, max_batch=4, prefill_chunk=CHUNK, linear_drafts=5)
    seqs = [make_sequence(ours, p, 20, ("linear", "ddtree", "none")[i % 3]) for i, p in enumerate(prompts)]
    for seq in seqs:
        core.add(seq)
    core.step()  # admits every request (their drafter tables exist from here on)
    long_refs = [run(ours, None, p, 20 + 6, prefill_chunk=CHUNK)[0] for p in prompts]
    install_batch_oracle(monkeypatch, {id(s.drafter): prompts[i] + long_refs[i] for i, s in enumerate(seqs)})
    drain(core)
    for i, seq in enumerate(seqs):
        assert seq.error is None and seq.sink.token_ids == references[i], seq.mode
    assert sum(seq.stats.rounds for seq in seqs) > 0


def test_guards_of_both_families_apply(pair: tuple[Any, CausalLM], folder: Path) -> None:
    """No CUDA graphs for float32 experts (the per-expert products read their counts on the host), no tensor
    parallelism, dense weights; DDTree alone and batched."""
    _, ours = pair
    assert not ours.capturable and ours.config.is_moe and ours.config.is_hybrid
    for batch in (1, 4):
        options = resolve_options(EngineOptions(spec="ddtree", max_batch=batch), device=torch.device("cuda"),
                                  has_drafter=True, tensor_parallel=False, capturable=ours.capturable,
                                  hybrid=ours.config.is_hybrid)
        assert not options.cuda_graphs and options.spec == "ddtree"
    with pytest.raises(ModelLoadError, match="not split"):
        shard_config(ours.config, 2)
    assert choose_weights("auto", folder, torch.device("cpu"), torch.float32).kind == "dense"
    with pytest.raises(ModelLoadError, match="quantized weights are not available"):
        choose_weights("quantized", folder, torch.device("cpu"), torch.float32)


def test_bad_checkpoints_are_load_errors(folder: Path, tmp_path: Path) -> None:
    for file in folder.iterdir():
        (tmp_path / file.name).write_bytes(file.read_bytes())
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["model.layers.2.mlp.experts.4.up_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"experts\.4\.up_proj"):
        load_hf_dir(tmp_path)
    raw = json.loads((folder / "config.json").read_text())
    with pytest.raises(ModelLoadError, match="at least one expert"):
        ModelConfig.from_hf({**raw, "num_experts": 0})


def test_absent_fields_take_transformers_defaults(folder: Path) -> None:
    """Fields a config.json may leave out take the configuration class's defaults; the fields that class does not
    have (dense layers, sparse step, optional rescaling) are ignored, as transformers ignores them."""
    raw = json.loads((folder / "config.json").read_text())
    for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size"):
        raw.pop(key)
    raw.update(mlp_only_layers=[1], decoder_sparse_step=2, norm_topk_prob=False, intermediate_size=96)
    defaults = transformers.Qwen3_5MoeTextConfig()
    config = ModelConfig.from_hf(raw)
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (
        defaults.num_experts, defaults.num_experts_per_tok, defaults.moe_intermediate_size
    )
    assert config.shared_expert_intermediate_size == defaults.shared_expert_intermediate_size
    assert config.norm_topk_prob and all(config.sparse_layer(i) for i in range(config.num_layers))


@pytest.mark.slow
def test_sampling_keeps_the_target_distribution(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sampled linear and DDTree requests in a batch (recurrent states rolled back, every layer a mixture) keep
    plain sampling's per-position distributions."""
    hf = hf_tiny_35_moe(seed=3, vocab_size=SAMPLED_VOCAB)
    with torch.no_grad():
        hf.lm_head.weight.mul_(3.0)  # next-token distributions far from uniform
    check_sampling_keeps_the_distribution(monkeypatch, ours_from_hf_hybrid(hf), [1, 3])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("mode", ["none", "linear", "ddtree:6"])
def test_graphed_hybrid_experts_give_the_eager_tokens_on_the_gpu(pair: tuple[Any, CausalLM], mode: str) -> None:
    """bf16 on a GPU: the hybrid mixture is capturable (experts without host decisions, recurrent state in the
    runner's buffers), and greedy generations replayed from CUDA graphs give the eager tokens (the same kernels)."""
    import copy

    from dflash.fastpath.runner import attach_graph_runner
    from dflash.generation.forwards import register_forwards
    from tests.test_fastpath import generate

    cuda = torch.device("cuda")
    model = copy.deepcopy(pair[1]).to(cuda, torch.bfloat16)
    drafter = _drafter().to(cuda, torch.bfloat16)
    assert model.capturable
    try:
        prompts = random_prompts(2, VOCAB, seed=31, lengths=(9, 40))
        eager = [generate(model, drafter, mode, p, 30) for p in prompts]
        runner = attach_graph_runner(model, drafter, capacity=512, fused=False)
        graphed = [generate(model, drafter, mode, p, 30) for p in prompts]
        assert graphed == eager and runner.served > 10 and runner.captured > 0
    finally:
        register_forwards(model, None)
