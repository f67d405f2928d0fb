"""DFlash against the public reference implementation's vectors (tiny random Qwen3 target and drafter)."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from dflash.config import ModelConfig
from dflash.drafter.loader import load_drafter
from dflash.drafter.model import DFlashDrafter
from dflash.generation.output import OutputSink
from dflash.generation.request import GenerationRequest
from dflash.generation.sampling import SamplingParams
from dflash.generation.selection import TokenChooser
from dflash.models.model import CausalLM
from dflash.models.registry import build_model
from dflash.speculative.linear import decode_linear
from tests.golden import load_dflash_tiny

ATOL = 1e-4


@pytest.fixture(scope="module")
def golden() -> tuple[dict[str, torch.Tensor], dict[str, Any], CausalLM, DFlashDrafter]:
    tensors, meta, path = load_dflash_tiny()
    config = ModelConfig.from_hf(json.loads((path / "target" / "config.json").read_text()))
    target = build_model(config, load_file(str(path / "target" / "model.safetensors")))
    drafter = load_drafter(str(path / "drafter"), config)
    return tensors, meta, target, drafter


def _run(target: CausalLM, drafter: DFlashDrafter, prompt: list[int]) -> tuple[list[int], list[int]]:
    request = GenerationRequest(prompt_ids=prompt, max_new_tokens=48)
    sink = OutputSink(lambda ids: "", eos_ids=(), max_new_tokens=48)
    chooser = TokenChooser(SamplingParams(), eos_ids=(), min_tokens=0, vocab_size=1024, device="cpu")
    stats = decode_linear(target, drafter, request, sink, chooser, prefill_chunk=64)
    return sink.token_ids, [a + 1 for a in stats.accepted_per_round]


def test_config_and_layer_ids(golden: Any) -> None:
    _, meta, _, drafter = golden
    assert list(drafter.config.target_layer_ids) == meta["target_layer_ids"] == [1, 3]
    assert drafter.config.block_size == 16 and drafter.config.mask_token_id == 1023


@torch.no_grad()
def test_detail_round_tensors(golden: Any) -> None:
    tensors, _, target, drafter = golden
    prompt = tensors["prompt1.input_ids"][None]
    cache = target.new_cache(128)
    out = target(prompt, cache=cache, capture=drafter.config.target_layer_ids)
    assert (out.logits[0, -1] - tensors["detail.prefill_last_logits"]).abs().max() <= ATOL
    assert (out.features[0] - tensors["detail.target_hidden"]).abs().max() <= ATOL
    ctx = drafter.context(out.features)
    assert (ctx[0] - tensors["detail.fc_hidden_norm_out"]).abs().max() <= ATOL
    first = int(out.logits[0, -1].argmax())
    assert first == 177
    block = tensors["detail.block_input_ids"][None]
    assert (target.embed(block)[0] - tensors["detail.noise_embedding"]).abs().max() <= ATOL
    drafter_cache = drafter.new_cache(128)
    start = prompt.shape[1]
    hidden = drafter.draft_hidden(
        target.embed(block), torch.arange(start, start + 16)[None], out.features, torch.arange(start)[None], drafter_cache
    )
    assert (hidden[0] - tensors["detail.drafter_hidden_out"]).abs().max() <= ATOL
    drafter_cache.crop(0)
    logits = drafter.draft_scores(target, first, start, out.features, drafter_cache).full()
    assert (logits - tensors["detail.draft_logits"]).abs().max() <= ATOL
    assert logits.argmax(-1).tolist() == tensors["detail.draft_ids"].tolist()
    verify = target(tensors["detail.verify_input_ids"][None], cache=cache)
    assert (verify.logits[0] - tensors["detail.verify_logits"]).abs().max() <= ATOL
    assert verify.logits[0].argmax(-1).tolist() == tensors["detail.posterior_ids"].tolist()


@pytest.mark.parametrize("name", ["prompt0", "prompt1", "prompt2", "prompt3", "extra0"])
def test_outputs_and_per_round_acceptance(golden: Any, name: str) -> None:
    tensors, _, target, drafter = golden
    prompt = tensors[f"{name}.input_ids"].tolist()
    tokens, acceptance = _run(target, drafter, prompt)
    assert tokens == tensors[f"{name}.dflash_output_ids"][len(prompt) :].tolist()
    assert tokens == tensors[f"{name}.ar_output_ids"][len(prompt) :].tolist()
    expected = tensors[f"{name}.acceptance_lengths"].tolist()
    # the reference runs while start < P + 48 and may finish one round after the 48th token is known
    assert acceptance == expected[: len(acceptance)]
    assert len(expected) - len(acceptance) in (0, 1)


@torch.no_grad()
def test_drafter_context_after_the_longest_round(golden: Any) -> None:
    """The round after the 14-token round feeds exactly the 14 accepted rows' features at positions 122..135."""
    tensors, meta, target, drafter = golden
    captured: list[tuple[torch.Tensor, torch.Tensor]] = []
    original = drafter.draft_hidden

    def spy(block_embeds: torch.Tensor, block_positions: torch.Tensor, new_features: torch.Tensor,
            new_positions: torch.Tensor, cache: Any, **kw: Any) -> torch.Tensor:
        captured.append((new_features.clone(), torch.cat((new_positions, block_positions), 1).clone()))
        return original(block_embeds, block_positions, new_features, new_positions, cache, **kw)

    drafter.draft_hidden = spy  # type: ignore[method-assign]
    try:
        _run(target, drafter, tensors["extra0.input_ids"].tolist())
    finally:
        del drafter.draft_hidden
    detail = meta["extra_prompts"][0]["after_max_detail"]
    round_index = detail["detail_round"]
    features, positions = captured[round_index]
    assert positions[0].tolist() == tensors["extra0.after_max.drafter_position_ids"].tolist()
    assert (features[0] - tensors["extra0.after_max.target_hidden"]).abs().max() <= ATOL
    assert features.shape[1] == detail["context_len"] == 14
