"""Speculative decoding is lossless: greedy output equals plain greedy output; sampling keeps the distribution."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch

from dflash.drafter.model import DFlashDrafter
from dflash.generation.sampling import SamplingParams
from tests.spec_helpers import golden_pair, patch_draft_logits, random_prompts, run, total_variation
from tests.tiny_models import hf_tiny, ours_from_hf

LENGTHS = (3, 17, 64, 65, 130, 257)  # short, around and beyond the prefill chunk of 64


def test_greedy_spec_equals_plain_greedy_on_30_prompts() -> None:
    target, drafter = golden_pair()
    accepted_rounds = 0
    for prompt in random_prompts(30, 1000, seed=11, lengths=LENGTHS):
        plain, _ = run(target, None, prompt, 128)
        spec, stats = run(target, drafter, prompt, 128)
        assert spec == plain
        accepted_rounds += sum(1 for a in stats.accepted_per_round if a > 0)
    assert accepted_rounds > 0  # the multi-token path was exercised


def test_chunk_size_does_not_change_spec_output() -> None:
    target, drafter = golden_pair()
    prompt = random_prompts(1, 1000, seed=5, lengths=(200,))[0]
    outputs = {chunk: run(target, drafter, prompt, 64, prefill_chunk=chunk)[0] for chunk in (7, 64, 1000)}
    assert outputs[7] == outputs[64] == outputs[1000]


def test_drafter_and_target_lengths_stay_in_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every round the drafter gets exactly the features of positions [its cache length, start); the prompt's are
    in its cache before the first round (absorbed chunk by chunk while the prompt was prefilled)."""
    target, drafter = golden_pair()
    seen: list[tuple[int, int, int]] = []

    def spy(original: Any, tgt: Any, pending: int, start: int, new_features: torch.Tensor, cache: Any,
            **kw: Any) -> torch.Tensor:
        seen.append((cache.length, new_features.shape[1], start))
        return original(tgt, pending, start, new_features, cache, **kw)

    patch_draft_logits(monkeypatch, drafter, spy)
    prompt = random_prompts(1, 1000, seed=1008, lengths=(94,))[0]
    run(target, drafter, prompt, 200)
    monkeypatch.undo()
    assert seen[0] == (94, 0, 94)
    for drafter_len, new_rows, start in seen:
        assert drafter_len + new_rows == start


# ---- sampling ------------------------------------------------------------------------------------------------

VOCAB = 8


def _peaky_tiny_pair() -> tuple[Any, DFlashDrafter]:
    hf = hf_tiny("llama", seed=3)
    hf.resize_token_embeddings(VOCAB)
    with torch.no_grad():
        hf.model.embed_tokens.weight.mul_(2.0)  # top-token probabilities around 0.4-0.65: real sampling
    hf.config.vocab_size = VOCAB
    target = ours_from_hf(hf)
    config_raw = {
        "num_hidden_layers": 1, "num_target_layers": 4, "hidden_size": 64, "intermediate_size": 64,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": VOCAB,
        "block_size": 4, "dflash_config": {"mask_token_id": VOCAB - 1, "target_layer_ids": [1]},
    }
    from dflash.drafter.model import DrafterConfig

    torch.manual_seed(7)
    drafter = DFlashDrafter(DrafterConfig.from_dict(config_raw)).eval().requires_grad_(False)
    return target, drafter


def _distribution(target: Any, drafter: DFlashDrafter | None, samples: int) -> list[Counter[int]]:
    per_position: list[Counter[int]] = [Counter() for _ in range(3)]
    for seed in range(samples):
        tokens, _ = run(target, drafter, [1, 2, 3], 3, sampling=SamplingParams(temperature=1.0, seed=seed))
        for i, token in enumerate(tokens):
            per_position[i][token] += 1
    return per_position



@pytest.mark.slow
def test_sampling_keeps_the_target_distribution(monkeypatch: pytest.MonkeyPatch) -> None:
    """Per-position next-token distributions of spec and plain sampling agree within TV 0.06 (n=1500 each).

    A control run with a broken rule (every first draft accepted) must exceed the tolerance, proving the test
    can fail."""
    target, drafter = _peaky_tiny_pair()
    samples, tolerance = 1500, 0.06
    plain = _distribution(target, None, samples)
    spec = _distribution(target, drafter, samples)
    distances = [total_variation(p, s) for p, s in zip(plain, spec, strict=True)]
    assert max(distances) < tolerance, distances

    import dflash.speculative.linear as linear

    monkeypatch.setattr(linear, "accepted_prefix_length", lambda draft, choices: 1)
    broken = _distribution(target, drafter, samples)
    broken_distances = [total_variation(p, s) for p, s in zip(plain, broken, strict=True)]
    assert max(broken_distances) > tolerance, broken_distances


def test_same_seed_same_output_when_sampling() -> None:
    target, drafter = golden_pair()
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=1234)
    prompt = random_prompts(1, 1000, seed=3, lengths=(40,))[0]
    first, _ = run(target, drafter, prompt, 40, sampling=params)
    second, _ = run(target, drafter, prompt, 40, sampling=params)
    other, _ = run(target, drafter, prompt, 40, sampling=SamplingParams(temperature=0.8, top_p=0.9, seed=99))
    assert first == second
    assert first != other
