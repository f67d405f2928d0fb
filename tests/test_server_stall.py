"""Agent stall recovery (DFLASH_MIN_TOKENS, DFLASH_STALL_TOOL_PREFIX, DFLASH_DEGENERATE_RUN_TOKENS): value-aware
environment parsing, and each recovery on and off against a scripted engine."""

from __future__ import annotations

import json
from collections.abc import Iterator

import openai
import pytest

from dflash.errors import DFlashError
from dflash.server import ServerSettings, StallSettings, create_app
from dflash.server.stall import DegenerateRun, looks_like_action_preamble
from tests.server_helpers import FakeEngine, metric, serving

pytestmark = pytest.mark.timeout(60)

WEATHER = {"type": "function", "function": {
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}},
}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.mark.parametrize(("value", "expected"), [
    ("", False), ("0", False), ("false", False), ("No", False), (" off ", False), ("1", True), ("TRUE", True),
    ("yes", True), ("on", True),
])
def test_flag_parsing(value: str, expected: bool) -> None:
    assert StallSettings.from_env({"DFLASH_STALL_TOOL_PREFIX": value}).tool_prefix is expected


def test_count_parsing_and_errors() -> None:
    env = {"DFLASH_MIN_TOKENS": "12", "DFLASH_DEGENERATE_RUN_TOKENS": "off"}
    assert StallSettings.from_env(env) == StallSettings(min_tokens=12, tool_prefix=False, degenerate_run_tokens=0)
    assert StallSettings.from_env({}) == StallSettings()  # everything off by default
    with pytest.raises(DFlashError, match="DFLASH_MIN_TOKENS='lots'"):
        StallSettings.from_env({"DFLASH_MIN_TOKENS": "lots"})
    with pytest.raises(DFlashError, match="DFLASH_STALL_TOOL_PREFIX='maybe'"):
        StallSettings.from_env({"DFLASH_STALL_TOOL_PREFIX": "maybe"})
    with pytest.raises(DFlashError, match="must not be negative"):
        StallSettings.from_env({"DFLASH_DEGENERATE_RUN_TOKENS": "-3"})


def test_from_process_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DFLASH_MIN_TOKENS", "7")
    monkeypatch.setenv("DFLASH_STALL_TOOL_PREFIX", "yes")
    monkeypatch.setenv("DFLASH_DEGENERATE_RUN_TOKENS", "0")
    assert StallSettings.from_env() == StallSettings(min_tokens=7, tool_prefix=True, degenerate_run_tokens=0)


@pytest.mark.parametrize(("text", "expected"), [
    ("Let me check the weather:", True),
    ("I'll look at the file.", True),
    ("Here are the files:", True),
    ("The weather is sunny.", False),
    ("Let me know if you need anything else!", False),
    ("", False),
])
def test_action_preamble(text: str, expected: bool) -> None:
    assert looks_like_action_preamble(text) is expected


def test_degenerate_run_detector() -> None:
    run = DegenerateRun(4)
    assert not run.observe([1, 2, 2, 2])
    assert run.observe([2])
    assert not DegenerateRun(3).observe([5, 5, 6, 6, 7, 7])


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=30)


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


def serve_with(engine: FakeEngine, stall: StallSettings) -> Iterator[str]:
    with serving(create_app(engine, ServerSettings(stall=stall))) as running:
        yield running.url


# ---------------------------------------------------------------------------------- DFLASH_MIN_TOKENS
@pytest.mark.parametrize("on", [True, False])
def test_min_tokens(engine: FakeEngine, on: bool) -> None:
    for url in serve_with(engine, StallSettings(min_tokens=20 if on else 0)):
        client = _client(url)
        engine.script("Ok", "Ok")
        with_tools = client.chat.completions.create(model="any", messages=ASK, tools=[WEATHER], max_tokens=100)
        without = client.chat.completions.create(model="any", messages=ASK, max_tokens=100)
    assert [r.min_tokens for r in engine.requests] == ([20, 0] if on else [0, 0])
    # the engine suppressed EOS before 20 tokens only where asked (tools present and the flag on)
    assert (with_tools.usage.completion_tokens >= 20) is on
    assert without.choices[0].message.content == "Ok"


# ---------------------------------------------------------------------------- DFLASH_STALL_TOOL_PREFIX
@pytest.mark.parametrize("on", [True, False])
def test_stall_tool_prefix(engine: FakeEngine, on: bool) -> None:
    engine.script("Let me check the weather:", '{"city": "Paris", "days": "2"}}\n</tool_call>')
    for url in serve_with(engine, StallSettings(tool_prefix=on)):
        result = _client(url).chat.completions.create(model="any", messages=ASK, tools=[WEATHER], max_tokens=200)
        continued = metric(url, "dflash_stall_continuations_total")
    choice = result.choices[0]
    assert choice.message.content == "Let me check the weather:"
    if on:
        assert len(engine.requests) == 2 and continued == 1
        # the continuation is the model's own output followed by a call opening for the only tool
        assert engine.prompts[1] == engine.prompts[0] + 'Let me check the weather:<tool_call>\n{"name": "get_weather", "arguments": '
        assert choice.finish_reason == "tool_calls"
        (call,) = choice.message.tool_calls or []
        assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris", "days": 2}
        opening = len('<tool_call>\n{"name": "get_weather", "arguments": ')
        tail = len('{"city": "Paris", "days": "2"}}\n</tool_call>') + 1
        assert result.usage.completion_tokens == len("Let me check the weather:") + opening + tail
    else:
        assert len(engine.requests) == 1 and continued == 0
        assert choice.finish_reason == "stop" and not choice.message.tool_calls


def test_stall_tool_prefix_needs_one_target_tool(engine: FakeEngine) -> None:
    engine.script("Let me check the weather:", "Let me check the weather:")
    for url in serve_with(engine, StallSettings(tool_prefix=True)):
        client = _client(url)
        ambiguous = client.chat.completions.create(model="any", messages=ASK, tools=[WEATHER, CLOCK], max_tokens=200)
        no_tools = client.chat.completions.create(model="any", messages=ASK, max_tokens=200)
    assert len(engine.requests) == 2  # neither turn was continued
    assert ambiguous.choices[0].finish_reason == "stop" and no_tools.choices[0].finish_reason == "stop"


def test_stall_tool_prefix_uses_the_forced_tool(engine: FakeEngine) -> None:
    # tool_choice "required" makes the turn open a call itself; a named choice picks the continuation's tool.
    engine.script('get_time", "arguments": {}}\n</tool_call>')
    for url in serve_with(engine, StallSettings(tool_prefix=True)):
        result = _client(url).chat.completions.create(
            model="any", messages=ASK, tools=[WEATHER, CLOCK], tool_choice="required", max_tokens=200,
        )
    assert engine.prompts[0].endswith('<tool_call>\n{"name": "')
    assert [c.function.name for c in result.choices[0].message.tool_calls or []] == ["get_time"]


# ------------------------------------------------------------------------ DFLASH_DEGENERATE_RUN_TOKENS
@pytest.mark.parametrize("on", [True, False])
def test_degenerate_run(engine: FakeEngine, on: bool) -> None:
    engine.script("Sure: " + "!" * 200)
    for url in serve_with(engine, StallSettings(degenerate_run_tokens=30 if on else 0)):
        result = _client(url).chat.completions.create(model="any", messages=ASK, max_tokens=500)
        stops = metric(url, "dflash_degenerate_stops_total")
        cancelled = metric(url, "dflash_cancelled_total", api="chat", stage="running")
    choice = result.choices[0]
    if on:
        assert choice.finish_reason == "length" and stops == 1
        assert choice.message.content == "Sure: " + "!" * 30
        assert result.usage.completion_tokens == len("Sure: ") + 30
    else:
        assert choice.finish_reason == "stop" and stops == 0
        assert choice.message.content == "Sure: " + "!" * 200
    assert cancelled == 0  # ending a degenerate turn is not a cancellation
