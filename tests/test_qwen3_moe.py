"""Qwen3-MoE: a tiny random transformers model (8 experts, top-2, one dense layer) loaded from an HF folder and from
a GGUF file matches transformers in float32, and speculative decoding over it stays lossless, alone and batched."""

from __future__ import annotations

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

from dflash.config import ModelConfig
from dflash.drafter.model import DFlashDrafter
from dflash.engine.engine import EngineOptions, resolve_options
from dflash.engine.loading import LoadOptions, load_engine
from dflash.errors import ModelLoadError
from dflash.fastpath import fused_layers
from dflash.generation.request import GenerationRequest
from dflash.models import gguf_loader
from dflash.models.checkpoint import Checkpoint
from dflash.models.gguf_loader import load_gguf
from dflash.models.hf_loader import load_hf_dir
from dflash.models.model import CausalLM
from dflash.models.moe import GROUPED_MM, SparseMoeBlock, StackedExperts
from dflash.models.qwen3_moe import Qwen3MoeForCausalLM
from dflash.models.registry import build_model
from dflash.models.weight_choice import choose_weights
from dflash.parallel.sharding import shard_config
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
from tests.tiny_models import hf_tiny, ours_from_hf

transformers = pytest.importorskip("transformers")

_one_thread = one_torch_thread  # autouse, module scope

EXPERTS, TOP_K, DENSE_LAYER = 8, 2, 2
PROMPT_LEN, CHUNK = 40, 16  # the prompt spans three prefill chunks


@cache
def hf_moe(**overrides: Any) -> Any:
    """4 layers (layer 2 dense through `mlp_only_layers`), 8 experts of width 32, top-2 with renormalisation."""
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(
        vocab_size=overrides.pop("vocab_size", train_byte_level_tokenizer().get_vocab_size()), hidden_size=64,
        intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=EXPERTS, num_experts_per_tok=TOP_K, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[DENSE_LAYER], max_position_embeddings=256, tie_word_embeddings=False, eos_token_id=0,
        **overrides,
    )
    model = transformers.Qwen3MoeForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:  # norms start at 1: randomise them so a misplaced norm shows
                param.add_(torch.randn_like(param) * 0.1)
            elif name.endswith("mlp.gate.weight"):  # a spread router: every token's top-2 is clear of the rest
                param.normal_(0.0, 0.5)
            elif "experts" in name:
                param.normal_(0.0, 0.1)
    return model


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("qwen3-moe")
    hf_moe().save_pretrained(str(path))
    train_byte_level_tokenizer().save(str(path / "tokenizer.json"))
    tok_config = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "chat_template": CHATML}
    (path / "tokenizer_config.json").write_text(json.dumps(tok_config))
    return path


@cache
def target() -> CausalLM:
    """Ours, from transformers' in-memory (fused) parameters."""
    return ours_from_hf(hf_moe())


def _prompt(seed: int, length: int = PROMPT_LEN) -> torch.Tensor:
    vocab = hf_moe().config.vocab_size
    return torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def _assert_matches_transformers(ours: CausalLM, hf: Any = None) -> None:
    """Chunked prefill then one-token steps through the cache give transformers' logits within 1e-4."""
    ids = _prompt(1)
    reference = (hf or hf_moe())(ids).logits  # [1, seq, vocab]
    kv = ours.new_cache(PROMPT_LEN)
    chunks = [ours(ids[:, lo : lo + CHUNK], cache=kv).logits for lo in range(0, PROMPT_LEN - 6, CHUNK)]
    for t in range(kv.length, PROMPT_LEN):
        chunks.append(ours(ids[:, t : t + 1], cache=kv).logits)
    logits = torch.cat([c for c in chunks if c is not None], dim=1)
    assert logits.shape == reference.shape
    assert (logits - reference).abs().max().item() <= 1e-4


# ---- configuration and loading -------------------------------------------------------------------------------


def test_config_reads_the_expert_fields(hf_folder: Path) -> None:
    raw = json.loads((hf_folder / "config.json").read_text())
    assert "num_local_experts" in raw  # transformers 5 saves the expert count under this name
    config = ModelConfig.from_hf(raw)
    assert config.architecture == "qwen3_moe" and config.qk_norm and config.is_moe
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (EXPERTS, TOP_K, 32)
    assert config.norm_topk_prob and config.mlp_only_layers == (DENSE_LAYER,)
    assert [config.sparse_layer(i) for i in range(4)] == [True, True, False, True]
    every_other = ModelConfig.from_hf({**raw, "decoder_sparse_step": 2, "mlp_only_layers": []})
    assert [every_other.sparse_layer(i) for i in range(4)] == [False, True, False, True]
    with pytest.raises(ModelLoadError, match="experts per token"):
        ModelConfig.from_hf({**raw, "num_experts_per_tok": EXPERTS + 1})


def test_routing_follows_transformers() -> None:
    """Same experts and the same weights (renormalised top-k) as transformers' router, token by token."""
    hf_block = hf_moe().model.layers[0].mlp
    ours = target().layers[0].mlp
    assert isinstance(ours, SparseMoeBlock)
    x = torch.randn(50, 64, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        _, hf_weights, hf_chosen = hf_block.gate(x)
        chosen, weights = ours.route(x)
        assert torch.equal(chosen, hf_chosen)
        assert torch.allclose(weights, hf_weights, atol=1e-6)
        assert torch.allclose(weights.sum(-1), torch.ones(50), atol=1e-6)
        assert (ours(x[None]) - hf_block(x[None])).abs().max().item() <= 1e-5


def test_hf_folder_loads_and_matches_transformers(hf_folder: Path) -> None:
    """save_pretrained writes one tensor per expert; the loader stacks them."""
    names = load_file(str(hf_folder / "model.safetensors")).keys()
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in names
    checkpoint = load_hf_dir(hf_folder)
    assert checkpoint.weights["model.layers.0.mlp.experts.gate_proj"].shape == (EXPERTS, 32, 64)
    assert "model.layers.2.mlp.gate_proj.weight" in checkpoint.weights  # the dense layer keeps its MLP
    model = build_model(checkpoint.config, checkpoint.weights)
    assert isinstance(model, Qwen3MoeForCausalLM)
    _assert_matches_transformers(model)


def test_fused_parameters_load_and_match_transformers() -> None:
    """transformers' in-memory names (gate_up_proj [experts, 2 * width, hidden]) are accepted too."""
    assert "model.layers.0.mlp.experts.gate_up_proj" in hf_moe().state_dict()
    _assert_matches_transformers(target())


def test_sliding_window_covers_every_layer() -> None:
    """With `use_sliding_window`, transformers windows all Qwen3-MoE layers (no `max_window_layers` rule)."""
    hf = hf_moe(use_sliding_window=True, sliding_window=8)
    ours = ours_from_hf(hf)
    assert ours.config.sliding_window == 8 and all(ours.sliding)
    _assert_matches_transformers(ours, hf)


def test_greedy_continuation_equals_transformers_generate() -> None:
    ids = _prompt(3)
    with torch.no_grad():
        reference = hf_moe().generate(ids, max_new_tokens=24, do_sample=False, pad_token_id=0)[0, PROMPT_LEN:]
    tokens, _ = run(target(), None, ids[0].tolist(), 24, prefill_chunk=CHUNK)
    assert tokens == reference.tolist()


def test_missing_expert_is_a_clear_error(hf_folder: Path, tmp_path: Path) -> None:
    for file in hf_folder.iterdir():
        (tmp_path / file.name).write_bytes(file.read_bytes())
    weights = load_file(str(tmp_path / "model.safetensors"))
    del weights["model.layers.1.mlp.experts.5.up_proj.weight"]
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"experts\.5\.up_proj.*7 of 8 experts"):
        load_hf_dir(tmp_path)


# ---- GGUF ----------------------------------------------------------------------------------------------------


def _write_moe_gguf(path: Path, expert_type: GGMLQuantizationType | None = None) -> Path:
    """The transformers model's weights under llama.cpp's qwen3moe names (experts as 3-D tensors, float32 or
    quantized to `expert_type`)."""
    hf = hf_moe()
    config = hf.config
    tok = gguf_tokenizer_metadata(train_byte_level_tokenizer())
    arch = "qwen3moe"
    metadata: dict[str, Any] = {
        f"{arch}.block_count": 4, f"{arch}.embedding_length": 64, f"{arch}.feed_forward_length": 96,
        f"{arch}.attention.head_count": 4, f"{arch}.attention.head_count_kv": 2, f"{arch}.attention.key_length": 16,
        f"{arch}.attention.value_length": 16, f"{arch}.attention.layer_norm_rms_epsilon": config.rms_norm_eps,
        f"{arch}.rope.freq_base": 10000.0, f"{arch}.context_length": 256, f"{arch}.expert_count": EXPERTS,
        f"{arch}.expert_used_count": TOP_K, f"{arch}.expert_feed_forward_length": 32, **tok,
    }
    state = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
    tensors: dict[str, np.ndarray] = {
        "token_embd.weight": state["model.embed_tokens.weight"],
        "output_norm.weight": state["model.norm.weight"],
        "output.weight": state["lm_head.weight"],
    }
    parts = {
        "self_attn.q_proj.weight": "attn_q", "self_attn.k_proj.weight": "attn_k", "self_attn.v_proj.weight": "attn_v",
        "self_attn.o_proj.weight": "attn_output", "self_attn.q_norm.weight": "attn_q_norm",
        "self_attn.k_norm.weight": "attn_k_norm", "input_layernorm.weight": "attn_norm",
        "post_attention_layernorm.weight": "ffn_norm", "mlp.gate.weight": "ffn_gate_inp",
        "mlp.gate_proj.weight": "ffn_gate", "mlp.up_proj.weight": "ffn_up", "mlp.down_proj.weight": "ffn_down",
        "mlp.experts.down_proj": "ffn_down_exps",
    }
    for i in range(4):
        for hf_part, gguf_part in parts.items():
            if f"model.layers.{i}.{hf_part}" in state:
                tensors[f"blk.{i}.{gguf_part}.weight"] = state[f"model.layers.{i}.{hf_part}"]
        fused = state.get(f"model.layers.{i}.mlp.experts.gate_up_proj")
        if fused is not None:  # [experts, 2 * width, hidden], gate rows first
            tensors[f"blk.{i}.ffn_gate_exps.weight"], tensors[f"blk.{i}.ffn_up_exps.weight"] = np.split(fused, 2, 1)
    written: dict[str, Any] = dict(tensors)
    if expert_type is not None:
        for name in tensors:
            if name.endswith("_exps.weight"):
                written[name] = quantized(tensors[name], expert_type)
    return write_gguf(path, arch, metadata, written)


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DFLASH_NO_CACHE", "1")
        yield _write_moe_gguf(tmp_path_factory.mktemp("gguf") / "tiny-qwen3moe.gguf")


def test_gguf_loads_and_matches_transformers(gguf_path: Path, hf_folder: Path) -> None:
    checkpoint: Checkpoint = load_gguf(gguf_path, use_cache=False)
    config = checkpoint.config
    from_hf = load_hf_dir(hf_folder).config
    assert config.architecture == "qwen3_moe" and config.qk_norm
    assert config.mlp_only_layers == (DENSE_LAYER,)  # found from the layer without a router
    for field in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                  "intermediate_size", "head_dim", "num_kv_heads"):
        assert getattr(config, field) == getattr(from_hf, field), field
    _assert_matches_transformers(build_model(config, checkpoint.weights))


def test_quantized_experts_are_dequantised_whole(tmp_path: Path) -> None:
    """Q8_0 expert tensors (3-D) come back as gguf's own dequantisation of each expert's rows, close to the
    float weights, and the model still follows transformers closely at most positions."""
    path = _write_moe_gguf(tmp_path / "q8-experts.gguf", GGMLQuantizationType.Q8_0)
    weights = load_gguf(path, use_cache=False).weights
    hf_down = hf_moe().state_dict()["model.layers.1.mlp.experts.down_proj"]  # [experts, hidden, width]
    ours = weights["model.layers.1.mlp.experts.down_proj"]
    expected = dequantize(quantize(hf_down.numpy(), GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0)
    assert torch.equal(ours, torch.from_numpy(expected).reshape(ours.shape))
    assert 0 < (ours - hf_down).abs().max().item() <= hf_down.abs().max().item() / 100
    model = build_model(load_gguf(path, use_cache=False).config, weights)
    ids = _prompt(1)
    with torch.no_grad():
        logits, reference = model(ids).logits, hf_moe()(ids).logits
    assert logits is not None
    close = (logits - reference).abs().amax(dim=-1) <= 3e-2  # [1, seq]
    assert close.float().mean().item() >= 0.9  # rounding may flip a near-tie between a token's 2nd and 3rd expert


def test_gguf_cache_keeps_the_expert_settings(
    gguf_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second load from the dequantised cache gives the same config (dense-layer list included) and experts."""
    monkeypatch.setenv("DFLASH_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("DFLASH_NO_CACHE")
    monkeypatch.setattr(gguf_loader, "CACHE_MIN_SECONDS", 0.0)
    first = load_gguf(gguf_path)
    assert any(tmp_path.rglob("*.safetensors"))
    monkeypatch.setattr(gguf_loader, "GGUFFile", None)  # a second parse would fail
    second = load_gguf(gguf_path)
    assert second.config == first.config and second.config.mlp_only_layers == (DENSE_LAYER,)
    name = "model.layers.3.mlp.experts.down_proj"
    assert torch.equal(second.weights[name], first.weights[name])


def test_quantized_cpu_path_declines_experts(gguf_path: Path) -> None:
    """`auto` falls back to dense weights with the reason; `quantized` asked for is an error."""
    choice = choose_weights("auto", gguf_path, torch.device("cpu"), torch.float32)
    assert choice.kind == "dense" and "mixture of experts" in choice.reason
    with pytest.raises(ModelLoadError, match="mixture of experts"):
        choose_weights("quantized", gguf_path, torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("max_batch", [1, 2])
def test_engine_serves_the_gguf_with_its_greedy_tokens(gguf_path: Path, max_batch: int) -> None:
    """Through `load_engine` (`--weights auto` settles on dense weights), one at a time and in the engine loop. On
    the CPU, where the reference runs: on a GPU the engine would decode in bf16, whose greedy tokens need not be
    float32's."""
    engine = load_engine(
        str(gguf_path), draft="none", options=EngineOptions(max_batch=max_batch, prefill_chunk=CHUNK),
        loading=LoadOptions(device="cpu"),
    )
    try:
        assert engine.batched == (max_batch > 1) and isinstance(engine.target, Qwen3MoeForCausalLM)
        prompt = _prompt(6, 21)[0].tolist()
        result = engine.generate(GenerationRequest(prompt_ids=prompt, max_new_tokens=16, ignore_eos=True))
        assert result.token_ids == run(target(), None, prompt, 16, prefill_chunk=CHUNK)[0]
    finally:
        engine.close()


# ---- fast paths that cannot run experts ----------------------------------------------------------------------


def test_fast_paths_decline_mixture_of_experts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fused_layers, "triton_available", lambda: True)
    assert fused_layers.supports_fused_layers(ours_from_hf(hf_tiny("qwen3")))  # the dense family is fused
    assert not fused_layers.supports_fused_layers(target())
    assert not target().capturable
    cuda = torch.device("cuda")
    options = resolve_options(EngineOptions(), device=cuda, has_drafter=True, tensor_parallel=False,
                              capturable=target().capturable)
    assert not options.cuda_graphs
    assert resolve_options(EngineOptions(), device=cuda, has_drafter=True, tensor_parallel=False).cuda_graphs
    with pytest.raises(ModelLoadError, match="mixture-of-experts"):
        shard_config(target().config, 2)
    assert shard_config(target().config, 1) is target().config


# ---- speculative decoding --------------------------------------------------------------------------------------


def _drafter() -> DFlashDrafter:
    return tiny_drafter(target().config.vocab_size, 4, [1, 3])


def test_linear_and_ddtree_greedy_equal_plain_greedy(monkeypatch: pytest.MonkeyPatch) -> None:
    check_linear_and_ddtree_equal_plain(monkeypatch, target(), _drafter(), CHUNK)


def test_batched_core_gives_each_request_its_plain_greedy_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plain, linear and DDTree requests decoding together (their rows share each expert's product) each give
    what plain decoding gives alone, with a mostly right drafter."""
    check_batched_core_equals_plain(monkeypatch, target(), _drafter(), CHUNK)


@pytest.mark.skipif(GROUPED_MM is None, reason="this PyTorch has no grouped product")
def test_grouped_experts_equal_the_per_expert_products() -> None:
    """The GPU's grouped product (run here on the CPU in float32) gives the per-expert loop's mix: tokens sharing
    experts, experts with no token, one token alone."""
    torch.manual_seed(3)
    experts = StackedExperts(EXPERTS, 32, 16, "silu")
    with torch.no_grad():
        experts.gate_up_proj.normal_(0.0, 0.2)
        experts.down_proj.normal_(0.0, 0.2)
    for tokens in (9, 1):
        x = torch.randn(tokens, 32)
        chosen = torch.rand(tokens, EXPERTS).topk(TOP_K, dim=-1).indices
        chosen[:, 0] = torch.where(chosen[:, 1] == 1, 0, 1)  # experts 0 and 1 shared, others may get nothing
        weights = torch.rand(tokens, TOP_K)
        expected = experts(x, chosen, weights)  # the per-expert products on the CPU
        torch.testing.assert_close(experts.grouped(x, chosen, weights), expected, rtol=1e-5, atol=1e-6)


def _bf16_on_gpu() -> tuple[CausalLM, DFlashDrafter]:
    import copy

    cuda = torch.device("cuda")
    return copy.deepcopy(target()).to(cuda, torch.bfloat16), _drafter().to(cuda, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("mode", ["none", "linear", "ddtree:6"])
def test_graphed_experts_give_the_eager_tokens_on_the_gpu(mode: str) -> None:
    """bf16 on a GPU: the experts run through the grouped product (close to the float32 per-expert mix), the
    target is capturable, and greedy generations replayed from CUDA graphs of the static forward give the eager
    tokens (the same kernels)."""
    from dflash.fastpath.runner import attach_graph_runner
    from dflash.generation.forwards import register_forwards
    from tests.test_fastpath import generate

    model, drafter = _bf16_on_gpu()
    assert model.capturable and fused_layers.supports_fused_layers(model)
    x = torch.randn(5, 64)
    chosen = torch.rand(5, EXPERTS).topk(TOP_K, dim=-1).indices
    weights = torch.rand(5, TOP_K)
    expected = target().layers[0].mlp.experts(x, chosen, weights)  # float32, per expert, CPU
    cuda = torch.device("cuda")
    mixed = model.layers[0].mlp.experts(x.to(cuda, torch.bfloat16), chosen.to(cuda), weights.to(cuda, torch.bfloat16))
    torch.testing.assert_close(mixed.float().cpu(), expected, rtol=3e-2, atol=3e-2)
    try:
        prompts = random_prompts(2, model.config.vocab_size, seed=31, lengths=(9, 40))
        eager = [generate(model, drafter, mode, p, 30) for p in prompts]
        runner = attach_graph_runner(model, drafter, capacity=512, fused=False)
        graphed = [generate(model, drafter, mode, p, 30) for p in prompts]
        assert graphed == eager and runner.served > 10
    finally:
        register_forwards(model, None)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_fused_expert_layers_give_the_eager_logits_within_bf16_rounding() -> None:
    """The fused layers around the grouped experts (other kernels than the eager forward's, so not the same bits
    in bf16): a 16-row verification and a one-row step replayed from their graphs give the eager logits within
    bf16 rounding on average (a near tie in a router may pick another expert for a row: that row then differs
    more, seen at 7% of the largest logit), and the same greedy choice at nearly every row."""
    from dflash.fastpath.runner import GraphRunner

    model, _ = _bf16_on_gpu()
    runner = GraphRunner(model, None, capacity=512, fused=True)
    assert runner.fused
    cache = runner.lease_target_cache(64)
    assert cache is not None
    ids = _prompt(4, 17).cuda()
    with torch.inference_mode():
        eager = model(ids).logits
        assert eager is not None
        first = runner.target_forward(ids[:, :16], None, cache, None, (), "all")
        step = runner.target_forward(ids[:, 16:], None, cache, None, (), "all")
    assert first is not None and step is not None and first.logits is not None and step.logits is not None
    fused = torch.cat((first.logits, step.logits), dim=1).float()
    reference = eager.float()
    scale = reference.abs().max().item()
    assert (fused[0, 0] - reference[0, 0]).abs().max().item() <= 0.01 * scale  # the first row: no cache read
    assert (fused - reference).abs().mean().item() <= 0.01 * scale  # a wiring mistake is off by the logits' size
    assert (fused.argmax(-1) == reference.argmax(-1)).float().mean().item() >= 0.9


@pytest.mark.slow
def test_sampling_keeps_the_target_distribution(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sampled linear and DDTree requests in a batch (rows routed to experts together) keep plain sampling's
    per-position distributions."""
    hf = hf_moe(vocab_size=SAMPLED_VOCAB)
    with torch.no_grad():
        hf.lm_head.weight.mul_(3.0)  # next-token distributions far from uniform
    check_sampling_keeps_the_distribution(monkeypatch, ours_from_hf(hf), [1, 3])
