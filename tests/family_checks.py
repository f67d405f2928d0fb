"""Lossless-decoding checks every model family's tests run on their tiny target: a small random drafter, linear
DFlash and DDTree against plain greedy (random and mostly right drafters), the batched core with plain, linear
and DDTree requests together, and sampled requests' distributions (`SAMPLED_VOCAB`-token targets)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from dflash.batch.core import BatchCore
from dflash.drafter.model import DFlashDrafter, DrafterConfig
from dflash.models.model import CausalLM
from tests.batch_helpers import drain, make_core, make_sequence, sampled_counts
from tests.spec_helpers import random_prompts, run, total_variation
from tests.test_batch_core import _install_oracle as install_batch_oracle
from tests.test_ddtree_decode import install_oracle, run_ddtree


def tiny_drafter(vocab: int, target_layers: int, layer_ids: list[int], block: int = 8) -> DFlashDrafter:
    """A one-layer random drafter reading `layer_ids` of a target with `target_layers` layers."""
    raw = {
        "num_hidden_layers": 1, "num_target_layers": target_layers, "hidden_size": 64, "intermediate_size": 64,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": vocab,
        "block_size": block, "dflash_config": {"mask_token_id": vocab - 1, "target_layer_ids": layer_ids},
    }
    torch.manual_seed(7)
    return DFlashDrafter(DrafterConfig.from_dict(raw)).eval().requires_grad_(False)


def check_linear_and_ddtree_equal_plain(
    monkeypatch: pytest.MonkeyPatch, target: CausalLM, drafter: DFlashDrafter, chunk: int
) -> None:
    """With the random drafter (drafts mostly rejected) and with a mostly right one (several accepted per round,
    tree paths through non-first children): linear and DDTree give the target's own greedy tokens."""
    for prompt in random_prompts(2, target.config.vocab_size, seed=5, lengths=(9, 37)):
        plain, _ = run(target, None, prompt, 30, prefill_chunk=chunk)
        assert run(target, drafter, prompt, 30, prefill_chunk=chunk)[0] == plain
        assert run_ddtree(target, drafter, prompt, 30, budget=8, prefill_chunk=chunk)[0] == plain
        with monkeypatch.context() as mp:
            install_oracle(mp, drafter, prompt + run(target, None, prompt, 30 + 9, prefill_chunk=chunk)[0])
            linear, linear_stats = run(target, drafter, prompt, 30, prefill_chunk=chunk)
            tree, tree_stats = run_ddtree(target, drafter, prompt, 30, budget=8, prefill_chunk=chunk)
        assert linear == plain and tree == plain
        assert linear_stats.acceptance_length > 2.0 and tree_stats.acceptance_length > 2.0


def check_batched_core_equals_plain(
    monkeypatch: pytest.MonkeyPatch, target: CausalLM, drafter: DFlashDrafter, chunk: int
) -> BatchCore:
    """Six requests (plain, linear, DDTree in turn) decoding together with a mostly right drafter each give what
    plain decoding gives alone. Returns the drained core (for checks of its pools)."""
    prompts = random_prompts(6, target.config.vocab_size, seed=12, lengths=(12, 40, 23))
    references = {i: run(target, None, p, 24, prefill_chunk=chunk)[0] for i, p in enumerate(prompts)}
    core = make_core(target, drafter, max_batch=6, prefill_chunk=chunk, ddtree_budget=8)
    seqs = [make_sequence(target, p, 24, ("linear", "ddtree", "none")[i % 3]) for i, p in enumerate(prompts)]
    for seq in seqs:
        core.add(seq)
    core.step()  # admits every request (their drafter tables exist from here on)
    long_refs = {i: run(target, None, p, 24 + 9, prefill_chunk=chunk)[0] for i, p in enumerate(prompts)}
    install_batch_oracle(monkeypatch, {id(s.drafter): prompts[i] + long_refs[i] for i, s in enumerate(seqs)})
    drain(core)
    for i, seq in enumerate(seqs):
        assert seq.error is None and seq.sink.token_ids == references[i], seq.mode
    return core


SAMPLED_VOCAB = 8  # a target's vocabulary for `check_sampling_keeps_the_distribution`


def check_sampling_keeps_the_distribution(
    monkeypatch: pytest.MonkeyPatch, target: CausalLM, layer_ids: list[int], *, samples: int = 3000,
    tolerance: float = 0.06,
) -> None:
    """Per-position token distributions of sampled linear and DDTree requests (temperature 1, 64 per batch, every
    step speculating, a random drafter with blocks of 4: paths that often end inside the tree) agree with plain
    sampling's within total variation `tolerance`. `target` has `SAMPLED_VOCAB` tokens (its head scaled up by the
    caller so that next-token distributions are far from uniform)."""
    assert target.config.vocab_size == SAMPLED_VOCAB
    block, new = 4, 4
    drafter = tiny_drafter(SAMPLED_VOCAB, target.config.num_layers, layer_ids, block=block)

    def speculate(core: BatchCore) -> None:
        monkeypatch.setattr(core.policy, "plan", lambda *args, **kwargs: True)

    def counts(mode: str, rounds: list[int] | None = None) -> list[Counter[int]]:
        return sampled_counts(target, drafter, mode, samples, new, budget=6, block=block, prepare=speculate,
                              rounds=rounds)

    reference = counts("none")
    for mode in ("linear", "ddtree"):
        rounds: list[int] = []
        distances = [total_variation(p, s) for p, s in zip(reference, counts(mode, rounds), strict=True)]
        assert max(distances) < tolerance, (mode, distances)
        assert sum(rounds) >= samples, mode  # the requests did speculate
