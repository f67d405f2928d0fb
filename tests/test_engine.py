"""Engine behaviour on the real default model: spec == plain at T=0, the safety net, request checks, CLI JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from dflash.engine.engine import Engine
from dflash.engine.loading import load_engine
from dflash.errors import GenerationError
from dflash.generation.request import GenerationRequest, GenerationResult, GenerationStats
from dflash.training.prompts import read_prompt_file

PROMPTS = Path(__file__).resolve().parents[1] / "benchmarks" / "prompts"


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    yield load_engine("default")


def _chats() -> list[list[dict[str, str]]]:
    files = ["humaneval.jsonl", "mtbench.jsonl", "sharegpt_heldout.jsonl"]
    chats = [chat for name in files for chat in read_prompt_file(PROMPTS / name)[:10]]
    chats[0] = [{"role": "user", "content": "word " * 300 + "\nSummarise the text above."}]  # > prefill chunk
    return chats


@pytest.mark.slow
def test_shipped_drafter_is_lossless_on_30_prompts(engine: Engine) -> None:
    """128 new tokens per prompt, greedy, fp32 on CPU: the default mode's output (DDTree) == plain decoding's."""
    assert engine.drafter is not None and engine.options.spec == "ddtree"
    accepted = 0
    for chat in _chats():
        ids = engine.chat_prompt_ids(chat)
        plain = engine.generate(GenerationRequest(prompt_ids=ids, max_new_tokens=128), spec="none")
        spec = engine.generate(GenerationRequest(prompt_ids=ids, max_new_tokens=128))
        assert spec.stats.rounds > 0 or len(spec.token_ids) <= 1
        assert spec.token_ids == plain.token_ids
        assert spec.text == plain.text
        accepted += spec.stats.accepted_tokens
    assert accepted > 0


@pytest.mark.slow
def test_shipped_drafter_linear_is_lossless(engine: Engine) -> None:
    rounds = 0
    for chat in _chats()[::3]:
        ids = engine.chat_prompt_ids(chat)
        plain = engine.generate(GenerationRequest(prompt_ids=ids, max_new_tokens=96), spec="none")
        chain = engine.generate(GenerationRequest(prompt_ids=ids, max_new_tokens=96), spec="linear")
        assert chain.token_ids == plain.token_ids
        rounds += chain.stats.rounds  # a prompt the model answers with EOS at once has no round
    assert rounds > 0


def test_context_limit_is_refused_clearly(engine: Engine) -> None:
    with pytest.raises(GenerationError, match="exceeds the context limit"):
        engine.generate(GenerationRequest(prompt_ids=[1] * 100, max_new_tokens=engine.max_ctx))
    with pytest.raises(GenerationError, match="outside the vocabulary"):
        engine.generate(GenerationRequest(prompt_ids=[10**9], max_new_tokens=4))


def test_empty_spec_result_falls_back_to_plain_decoding(engine: Engine, monkeypatch: pytest.MonkeyPatch,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    original = engine._run

    def broken_spec(request: GenerationRequest, mode: str, on_text, should_stop) -> GenerationResult:  # type: ignore[no-untyped-def]
        if mode != "none":
            return GenerationResult(text="", token_ids=[2], finish_reason="stop", stats=GenerationStats(rounds=1))
        return original(request, mode, on_text, should_stop)

    monkeypatch.setattr(engine, "_run", broken_spec)
    ids = engine.chat_prompt_ids([{"role": "user", "content": "What is the capital of France?"}])
    result = engine.generate(GenerationRequest(prompt_ids=ids, max_new_tokens=16))
    assert "Paris" in result.text
    assert result.stats.fallbacks == 1
    assert any("retrying with plain decoding" in r.message for r in caplog.records)


def test_stop_string_and_streaming(engine: Engine) -> None:
    pieces: list[str] = []
    ids = engine.chat_prompt_ids([{"role": "user", "content": "Count from 1 to 10, separated by commas."}])
    result = engine.generate(GenerationRequest(prompt_ids=ids, max_new_tokens=40, stop=("5",)),
                             on_text=lambda text, _ids: pieces.append(text))
    assert result.finish_reason == "stop" and result.stop_reason == "5"
    assert "5" not in result.text and "".join(pieces) == result.text


def test_cli_generate_json() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "dflash", "generate", "--prompt", "Say hello.", "--max-tokens", "12", "--json"],
        capture_output=True, text=True, timeout=300, check=True,
    )
    data = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(data) == {"text", "token_ids", "finish_reason", "stats"}
    assert data["text"] and data["finish_reason"] in ("stop", "length")
    stats = data["stats"]
    for key in ("prompt_tokens", "completion_tokens", "prefill_s", "decode_s", "tokens_per_s", "rounds",
                "acceptance_length", "acceptance_histogram"):
        assert key in stats
    assert stats["spec"] == "ddtree"
