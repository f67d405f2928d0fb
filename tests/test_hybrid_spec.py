"""Speculative decoding on a hybrid (Gated DeltaNet) target: rejected drafts must leave no trace in the recurrent
state, so linear DFlash gives exactly the plain greedy tokens whatever the drafter proposes."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from dflash.drafter.model import DFlashDrafter, DrafterConfig
from dflash.engine.engine import Engine, EngineOptions
from dflash.errors import GenerationError
from dflash.generation.request import GenerationRequest
from dflash.kv.recurrent import ROLLBACK_MAX_ROWS
from dflash.models.hf_loader import load_hf_dir
from dflash.models.model import CausalLM
from tests.hybrid_models import hf_tiny_hybrid, ours_from_hf_hybrid
from tests.loading_helpers import train_byte_level_tokenizer
from tests.spec_helpers import one_torch_thread, patch_draft_logits, random_prompts, run

_threads = one_torch_thread

VOCAB = 512
BLOCK = 6  # the drafter proposes BLOCK - 1 = 5 tokens per round


def _drafter(seed: int = 7) -> DFlashDrafter:
    raw = {
        "num_hidden_layers": 1, "num_target_layers": 4, "hidden_size": 64, "intermediate_size": 64,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": VOCAB,
        "block_size": BLOCK, "dflash_config": {"mask_token_id": VOCAB - 1, "target_layer_ids": [1, 2]},
    }
    torch.manual_seed(seed)
    return DFlashDrafter(DrafterConfig.from_dict(raw)).eval().requires_grad_(False)


@pytest.fixture(scope="module")
def target() -> CausalLM:
    return ours_from_hf_hybrid(hf_tiny_hybrid(seed=11))


def test_random_drafter_is_lossless(target: CausalLM) -> None:
    drafter = _drafter()
    for prompt in random_prompts(3, VOCAB, seed=5, lengths=(9, 70)):  # 70: two prefill chunks of 64
        plain, _ = run(target, None, prompt, 30)
        spec, stats = run(target, drafter, prompt, 30)
        assert spec == plain and stats.rounds > 0


def test_oracle_drafts_accepted_at_every_length(target: CausalLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """Drafts that follow the plain greedy continuation for a chosen number of tokens, then go wrong: every
    accepted count from 0 to the whole block occurs, and the output still equals plain greedy decoding."""
    prompt = random_prompts(1, VOCAB, seed=8, lengths=(23,))[0]
    plain, _ = run(target, None, prompt, 60)
    drafter = _drafter()
    rounds = [0]

    def oracle(original: Any, target: CausalLM, pending: int, start: int, *args: Any, **kwargs: Any) -> torch.Tensor:
        logits = original(target, pending, start, *args, **kwargs)  # [drafts, vocab], for the shape
        drafts = logits.shape[0]
        correct = rounds[0] % (drafts + 1)  # 0, 1, ..., drafts, 0, ...
        rounds[0] += 1
        wanted = []
        for i in range(drafts):
            at = start - len(prompt) + 1 + i  # index in the generated tokens of draft i
            truth = plain[at] if at < len(plain) else 0
            wanted.append(truth if i != correct else (truth + 1) % VOCAB)  # only draft `correct` is wrong
        scores = torch.full_like(logits, -10.0)
        scores[torch.arange(drafts), torch.tensor(wanted)] = 10.0
        return scores

    patch_draft_logits(monkeypatch, drafter, oracle)
    spec, stats = run(target, drafter, prompt, 60)
    assert spec == plain
    assert set(stats.accepted_per_round) >= set(range(BLOCK))  # 0 .. BLOCK - 1 drafts kept, each at least once


def _engine(target: CausalLM, tmp_path: Path, options: EngineOptions) -> Engine:
    train_byte_level_tokenizer().save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    hf = hf_tiny_hybrid(seed=11)
    hf.save_pretrained(str(tmp_path))
    checkpoint = load_hf_dir(tmp_path)
    assert checkpoint.tokenizer is not None
    return Engine(target, checkpoint.tokenizer, _drafter(), options)


def test_engine_verifies_trees_one_request_at_a_time(
    target: CausalLM, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """With max batch 1 (the single-request loops) DDTree verifies trees on a hybrid (CUDA graphs stay allowed: on
    a GPU the graph runner carries the recurrent state); every strategy a request asks for gives the plain tokens.
    The batched step keeps DDTree too."""
    with caplog.at_level(logging.INFO, logger="dflash.engine"):
        engine = _engine(target, tmp_path, EngineOptions(spec="ddtree", max_batch=1))
    options = engine.options
    assert (options.spec, options.max_batch, options.cuda_graphs) == ("ddtree", 1, True)
    assert not engine.batched
    assert "verifying drafts linearly" not in caplog.text
    prompt = random_prompts(1, VOCAB, seed=9, lengths=(17,))[0]
    results = {
        spec: engine.generate(GenerationRequest(prompt_ids=prompt, max_new_tokens=20, ignore_eos=True), spec=spec)
        for spec in ("none", "linear", "ddtree")
    }
    assert results["ddtree"].token_ids == results["linear"].token_ids == results["none"].token_ids
    assert results["ddtree"].stats.rounds > 0
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="dflash.engine"):
        batched = _engine(target, tmp_path, EngineOptions(spec="ddtree", max_batch=4))
    assert batched.batched and batched.options.spec == "ddtree"
    batched.close()


def test_a_hybrid_tree_stays_within_what_its_state_can_replay(
    target: CausalLM, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A DDTree budget whose tree (root included) would exceed the rows the recurrent state keeps for a rollback is
    capped at start-up (logged), so no request fails mid-generation; the capped tree still gives the plain tokens."""
    with caplog.at_level(logging.INFO, logger="dflash.engine"):
        engine = _engine(target, tmp_path, EngineOptions(spec="ddtree", max_batch=1, ddtree_budget=100))
    assert engine.options.ddtree_budget == ROLLBACK_MAX_ROWS - 1 and "DDTree budget 63" in caplog.text
    prompt = random_prompts(1, VOCAB, seed=3, lengths=(9,))[0]
    request = GenerationRequest(prompt_ids=prompt, max_new_tokens=12, ignore_eos=True)
    tree = engine.generate(request, spec="ddtree")
    assert tree.token_ids == engine.generate(request, spec="none").token_ids and tree.stats.rounds > 0
    assert _engine(target, tmp_path, EngineOptions(spec="ddtree", max_batch=1, ddtree_budget=8)).options.ddtree_budget == 8


def _tree_inputs(parents: list[int], start: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random tokens [1, n], positions [1, n] (start + depth) and the ancestor mask [n, n] of a tree."""
    n = len(parents)
    mask = torch.eye(n, dtype=torch.bool)
    depth = [0] * n
    for node, parent in enumerate(parents):
        if parent >= 0:
            mask[node] |= mask[parent]
            depth[node] = depth[parent] + 1
    tokens = torch.randint(0, VOCAB - 1, (1, n), generator=torch.Generator().manual_seed(seed))
    return tokens, (start + torch.tensor(depth))[None], mask


def _path(parents: list[int], node: int) -> list[int]:
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


@torch.no_grad()
def test_tree_rows_equal_linear_passes_along_their_paths(target: CausalLM) -> None:
    """Every row of a tree verification (each from its parent's recurrent state and convolution window) gives the
    logits of a linear pass along its own path; keeping a path that is not a prefix of the rows (`compact`)
    leaves the cache where a linear pass along it would, and the next step agrees."""
    prompt = torch.tensor([random_prompts(1, VOCAB, seed=21, lengths=(19,))[0]])
    parents = [-1, 0, 0, 1, 2, 2, 5, 3]  # branches at rows 0 and 2; paths deeper than the convolution's window
    tokens, positions, mask = _tree_inputs(parents, prompt.shape[1], seed=3)

    def prefilled() -> Any:
        cache = target.new_cache(64)
        target(prompt, cache=cache)
        return cache

    cache = prefilled()
    tree = target(tokens, positions, cache, tree_mask=mask).logits[0]  # [rows, vocab]
    for node in range(len(parents)):
        path = _path(parents, node)
        linear_cache = prefilled()
        linear = target(tokens[:, path], cache=linear_cache).logits[0, -1]
        torch.testing.assert_close(tree[node], linear, rtol=1e-5, atol=1e-5, msg=f"row {node}")
    kept = _path(parents, 6)  # [0, 2, 5, 6]: not the first rows
    cache.compact(prompt.shape[1], torch.tensor(kept) + prompt.shape[1])
    linear_cache = prefilled()
    target(tokens[:, kept], cache=linear_cache)
    assert cache.length == linear_cache.length == prompt.shape[1] + len(kept)
    following = torch.tensor([[7]])
    torch.testing.assert_close(
        target(following, cache=cache).logits, target(following, cache=linear_cache).logits, rtol=1e-5, atol=1e-5
    )


def test_tree_verification_rolls_back_only_to_a_path(target: CausalLM) -> None:
    """After a tree forward the state must be cut to one of its paths: a kept row list that skips the tree's
    order, or a forward that did not start where the cache says, is an error, not a silent wrong state."""
    prompt = torch.tensor([random_prompts(1, VOCAB, seed=22, lengths=(9,))[0]])
    cache = target.new_cache(32)
    with torch.no_grad():
        target(prompt, cache=cache)
        tokens, positions, mask = _tree_inputs([-1, 0, 0], 9, seed=4)
        target(tokens, positions, cache, tree_mask=mask)
    recurrent = cache.recurrent
    assert recurrent is not None
    with pytest.raises(GenerationError, match="cannot keep"):
        recurrent.keep(9, [11, 10])
    with pytest.raises(GenerationError, match="cannot keep"):
        recurrent.keep(8, [9, 10])
    with pytest.raises(GenerationError, match="no attention mask"):
        target(tokens, positions, cache, attn_mask=torch.ones(1, 3, 12, dtype=torch.bool))


def test_ddtree_greedy_equals_plain_greedy_on_the_hybrid(target: CausalLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """DDTree with a random drafter and with a mostly right one (trees whose accepted paths run through
    non-first children, so the cache keeps paths that are not a prefix of the rows): the plain greedy tokens."""
    from tests.family_checks import check_linear_and_ddtree_equal_plain

    check_linear_and_ddtree_equal_plain(monkeypatch, target, _drafter(), 16)


def test_fast_paths_decline_hybrid_models(target: CausalLM) -> None:
    """No fused layers and no tensor parallelism for linear-attention layers (graphs: `test_hybrid_graphs.py`)."""
    from dflash.fastpath.fused_layers import supports_fused_layers
    from dflash.parallel.sharding import shard_config

    assert not supports_fused_layers(target)
    from dflash.errors import ModelLoadError

    with pytest.raises(ModelLoadError, match="not split"):
        shard_config(target.config, 2)


def _with_prefix_cache(
    target: CausalLM, drafter: DFlashDrafter | None, prompt: list[int], prefix_cache: Any, max_new: int
) -> tuple[list[int], int]:
    """(tokens, prompt positions restored) of one generation through `prefix_cache`, prefill chunk 8."""
    from dflash.generation.autoregressive import decode_autoregressive
    from dflash.generation.output import OutputSink
    from dflash.generation.sampling import SamplingParams
    from dflash.generation.selection import TokenChooser
    from dflash.speculative.linear import decode_linear

    request = GenerationRequest(prompt_ids=prompt, max_new_tokens=max_new)
    sink = OutputSink(lambda ids: "", eos_ids=(), max_new_tokens=max_new)
    chooser = TokenChooser(SamplingParams(), eos_ids=(), min_tokens=0, vocab_size=VOCAB, device="cpu")
    if drafter is None:
        stats = decode_autoregressive(target, request, sink, chooser, prefill_chunk=8, prefix_cache=prefix_cache)
    else:
        stats = decode_linear(target, drafter, request, sink, chooser, prefill_chunk=8, prefix_cache=prefix_cache)
    return sink.token_ids, stats.cached_tokens


@pytest.mark.parametrize("speculative", [False, True])
def test_prefix_cache_resumes_the_recurrent_state(target: CausalLM, speculative: bool) -> None:
    """Blocks keep the linear-attention state at their end: a prompt sharing a cached prefix resumes from the
    deepest shared block and decodes exactly as a cold prefill does."""
    from dflash.kv.prefix_cache import PrefixCache

    drafter = _drafter() if speculative else None
    layers = drafter.config.target_layer_ids if drafter is not None else ()
    prefix_cache = PrefixCache(2**24, block_tokens=8, feature_layers=layers)
    first = random_prompts(1, VOCAB, seed=12, lengths=(30,))[0]
    second = first[:21] + random_prompts(1, VOCAB, seed=15, lengths=(12,))[0]  # shares 2 blocks and 5 tokens
    cold = {tuple(p): run(target, None, p, 12)[0] for p in (first, second)}
    assert _with_prefix_cache(target, drafter, first, prefix_cache, 12) == (cold[tuple(first)], 0)
    assert prefix_cache.stats().blocks == 3  # positions 0 .. 23
    assert _with_prefix_cache(target, drafter, first, prefix_cache, 12) == (cold[tuple(first)], 24)
    assert _with_prefix_cache(target, drafter, second, prefix_cache, 12) == (cold[tuple(second)], 16)


def test_batched_core_keeps_each_requests_state(
    target: CausalLM, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Requests decoding together through the batched core (prefill chunks packed with other requests'
    verification blocks and trees, each with its own linear-attention state and rollback) give the tokens each
    gives alone. The speculation policy, which times real steps, is told to speculate every step: rollbacks must
    happen."""
    from dflash.kv.prefix_cache import PrefixCache
    from tests.batch_helpers import drain, make_core, make_sequence

    drafter = _drafter()
    prompts = random_prompts(4, VOCAB, seed=13, lengths=(9, 40, 75, 17))
    alone = [run(target, None, prompt, 24)[0] for prompt in prompts]
    prefix_cache = PrefixCache(2**24, block_tokens=16, feature_layers=drafter.config.target_layer_ids)
    core = make_core(
        target, drafter, max_batch=4, prefill_chunk=16, linear_drafts=BLOCK - 1, prefix_cache=prefix_cache
    )
    monkeypatch.setattr(core.policy, "plan", lambda *args, **kwargs: True)
    for attempt in range(2):  # the second time, prompts resume from the prefix cache's blocks and their states
        sequences = [
            make_sequence(target, prompt, 24, ("none", "linear", "ddtree")[i % 3]) for i, prompt in enumerate(prompts)
        ]
        for seq in sequences:
            core.add(seq)
        drain(core)
        assert [seq.sink.token_ids for seq in sequences] == alone
        assert sum(seq.stats.rounds for seq in sequences) > 0
        cached = [seq.stats.cached_tokens for seq in sequences]
        assert cached == ([0, 0, 0, 0] if attempt == 0 else [0, 32, 64, 16])


def test_engine_batches_hybrid_requests(target: CausalLM, tmp_path: Path) -> None:
    """Through the engine's batched loop, every strategy (DDTree trees included) gives the plain tokens."""
    engine = _engine(target, tmp_path, EngineOptions(spec="ddtree", max_batch=4))
    assert engine.batched
    try:
        prompt = random_prompts(1, VOCAB, seed=14, lengths=(20,))[0]
        request = GenerationRequest(prompt_ids=prompt, max_new_tokens=16, ignore_eos=True)
        plain, _ = run(target, None, prompt, 16)
        for spec in ("ddtree", "linear", "none"):
            result = engine.generate(request, spec=spec)
            assert result.token_ids == plain and (result.stats.rounds > 0) == (spec != "none"), spec
    finally:
        engine.close()


def test_kv_rows_only_for_attention_layers(target: CausalLM) -> None:
    """The single-request cache, the batched pool and the memory estimate hold K/V rows for the one full-attention
    layer only (`ModelConfig.cache_layers`, which also leaves out Gemma 4's K/V-sharing layers)."""
    from dflash.batch.memory import bytes_per_position
    from tests.batch_helpers import make_core

    config = target.config
    assert config.cache_layers == 1
    assert target.new_cache(8).keys.shape == (1, 1, config.num_kv_heads, 8, config.head_dim)
    assert make_core(target, None, max_batch=1).target_pool.keys.shape[0] == 1
    element = target.embed_tokens.weight.element_size()
    assert bytes_per_position(target, None) == 2 * config.num_kv_heads * config.head_dim * element
