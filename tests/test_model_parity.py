"""Our runtime against transformers on tiny random models of each family (fp32)."""

from __future__ import annotations

import pytest
import torch

from tests.tiny_models import hf_tiny, ours_from_hf

FAMILIES = ["llama", "qwen3", "gemma3"]
PROMPT_LEN = 40  # longer than the gemma3 tiny sliding window (16)


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request: pytest.FixtureRequest) -> tuple[torch.nn.Module, torch.nn.Module]:
    hf = hf_tiny(request.param)
    return hf, ours_from_hf(hf)


def _prompt(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 512, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def test_logits_and_features_match_transformers(pair: tuple[torch.nn.Module, torch.nn.Module]) -> None:
    hf, ours = pair
    ids = _prompt()
    ref = hf(ids, output_hidden_states=True)
    out = ours(ids, capture=[0, 1, 2])
    assert out.logits is not None and out.features is not None
    assert (out.logits - ref.logits).abs().max().item() <= 1e-4
    expected = torch.cat([ref.hidden_states[i + 1] for i in (0, 1, 2)], dim=-1)
    assert torch.allclose(out.features, expected, atol=1e-5)


@torch.no_grad()
def test_chunked_prefill_and_cached_decode_match_one_shot(pair: tuple[torch.nn.Module, torch.nn.Module]) -> None:
    hf, ours = pair
    ids = _prompt(2)
    ref = hf(ids).logits
    one_shot = ours(ids, capture=[1, 3])
    cache = ours.new_cache(64)
    logits, features = [], []
    for lo in range(0, PROMPT_LEN, 7):  # uneven chunks, then single tokens
        chunk = ids[:, lo : lo + 7]
        out = ours(chunk, cache=cache, capture=[1, 3])
        logits.append(out.logits)
        features.append(out.features)
    assert cache.length == PROMPT_LEN
    assert (torch.cat(logits, 1) - ref).abs().max().item() <= 1e-4
    assert torch.allclose(torch.cat(features, 1), one_shot.features, atol=1e-5)
    # one-token steps through the cache equal the full recomputation
    cache.crop(PROMPT_LEN - 5)
    for t in range(PROMPT_LEN - 5, PROMPT_LEN):
        step = ours(ids[:, t : t + 1], cache=cache)
        assert (step.logits[0, -1] - ref[0, t]).abs().max().item() <= 1e-4


@torch.no_grad()
def test_greedy_generation_matches_transformers_generate(pair: tuple[torch.nn.Module, torch.nn.Module]) -> None:
    hf, ours = pair
    ids = _prompt(3)
    ref = hf.generate(ids, max_new_tokens=24, do_sample=False, pad_token_id=0)[0, PROMPT_LEN:].tolist()
    cache = ours.new_cache(PROMPT_LEN + 24)
    out = ours(ids, cache=cache, logits="last")
    tokens = []
    for _ in range(24):
        token = int(out.logits[0, -1].argmax())
        tokens.append(token)
        out = ours(torch.tensor([[token]]), cache=cache)
    assert tokens == ref


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_attention_biases_match_transformers(family: str) -> None:
    """With attention_bias every attention projection has a bias, the output projection's included (it was once
    dropped without a word): logits equal transformers' with random biases."""
    hf = hf_tiny(family, attention_bias=True)
    assert hf.model.layers[0].self_attn.o_proj.bias.abs().sum() > 0
    ours = ours_from_hf(hf)
    ids = _prompt(3)
    assert (ours(ids).logits - hf(ids).logits).abs().max().item() <= 1e-4
