"""The packaged SmolLM2-135M-Instruct with quantized weights: against the dense float32 model (logits,
greedy text) and against itself under speculative decoding with the shipped drafter."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dflash.engine.engine import Engine
from dflash.engine.loading import LoadOptions, load_engine
from dflash.generation.request import GenerationRequest
from dflash.models.cpu_matmul import int8_obstacle
from dflash.models.quantized_layers import QuantizedLinear, uses_quantized_weights
from dflash.training.prompts import read_prompt_file

PROMPTS = Path(__file__).resolve().parents[1] / "benchmarks" / "prompts"
# Observed: max |logit difference| about 1.2e-4 on logits of magnitude up to about 38 (float32 summation
# order; the dequantised weights themselves are bitwise the dense loader's). 1e-3 leaves a margin of 8.
LOGIT_TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def quantized() -> Engine:
    engine = load_engine("default", "default", loading=LoadOptions(weights="quantized", cpu_matmul="float32"))
    assert uses_quantized_weights(engine.target) and engine.drafter is not None
    return engine


@pytest.fixture(scope="module")
def dense() -> Engine:
    engine = load_engine("default", "none", loading=LoadOptions(weights="dense"))
    assert not uses_quantized_weights(engine.target)
    return engine


def _chats() -> list[list[dict[str, str]]]:
    chats = [read_prompt_file(PROMPTS / name)[i] for name in ("humaneval.jsonl", "mtbench.jsonl") for i in (1, 4)]
    chats.append([{"role": "user", "content": "Give me three tips for sleeping better."}])
    return chats


def test_logits_match_the_dense_model(quantized: Engine, dense: Engine) -> None:
    ids = quantized.chat_prompt_ids(_chats()[0])
    x = torch.tensor([ids])
    with torch.inference_mode():
        assert torch.equal(quantized.target.embed(x), dense.target.embed(x))
        got = quantized.target(x).logits
        want = dense.target(x).logits
    assert got is not None and want is not None
    assert want.abs().max().item() > 10.0
    assert (got - want).abs().max().item() <= LOGIT_TOLERANCE
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_greedy_text_matches_the_dense_model(quantized: Engine, dense: Engine) -> None:
    """48 greedy tokens on each chat prompt: the quantized model says exactly what the dense model says."""
    for chat in _chats():
        ids = quantized.chat_prompt_ids(chat)
        ours = quantized.generate(GenerationRequest(prompt_ids=ids, max_new_tokens=48), spec="none")
        reference = dense.generate(GenerationRequest(prompt_ids=ids, max_new_tokens=48), spec="none")
        assert len(reference.token_ids) >= 32
        assert ours.token_ids == reference.token_ids


def test_speculative_decoding_is_lossless_on_the_quantized_target(quantized: Engine) -> None:
    """The shipped drafter (Q8_0 blocks on the kernel, as loaded beside a quantized target) on the quantized
    target: linear and DDTree speculation give exactly the quantized target's own greedy output."""
    assert_speculation_is_lossless(quantized)


@pytest.mark.skipif(int8_obstacle() is not None, reason="no int8 dot products on this CPU")
def test_speculative_decoding_is_lossless_on_int8_products() -> None:
    """The same on the int8-inputs kernel (`--cpu-matmul int8`), target and drafter."""
    engine = load_engine("default", "default", loading=LoadOptions(weights="quantized", cpu_matmul="int8"))
    assert engine.cpu_matmul == "int8"
    assert {m.products for m in engine.target.modules() if isinstance(m, QuantizedLinear)} == {"int8"}
    assert_speculation_is_lossless(engine)


def assert_speculation_is_lossless(quantized: Engine) -> None:
    assert quantized.drafter is not None and uses_quantized_weights(quantized.drafter)
    accepted = 0
    for chat in _chats():
        ids = quantized.chat_prompt_ids(chat)
        plain = quantized.generate(GenerationRequest(prompt_ids=ids, max_new_tokens=64), spec="none")
        linear = quantized.generate(GenerationRequest(prompt_ids=ids, max_new_tokens=64), spec="linear")
        assert linear.token_ids == plain.token_ids
        assert linear.text == plain.text
        accepted += linear.stats.accepted_tokens
    assert accepted > 0
    for chat in _chats()[1::2]:
        ids = quantized.chat_prompt_ids(chat)
        plain = quantized.generate(GenerationRequest(prompt_ids=ids, max_new_tokens=48), spec="none")
        tree = quantized.generate(GenerationRequest(prompt_ids=ids, max_new_tokens=48), spec="ddtree")
        assert tree.token_ids == plain.token_ids
