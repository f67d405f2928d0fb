"""The prefix cache behind `dflash serve` (real default model and drafter, real uvicorn), driven by the official
SDKs: cached tokens in the usage of chat completions (plain and streamed), Responses and Anthropic Messages
(plain and streamed, where message_start already reports the cached read), the same answer with and without
the cache, the body and header opt-outs, the metrics, and a request whose client goes away mid-prefill: the
chunks it completed are kept, and the same request sent again resumes from them."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest

from dflash.engine.engine import Engine, EngineOptions
from dflash.engine.loading import load_engine
from dflash.server import ServerSettings, create_app
from tests.server_helpers import ServerThread, metric, sdk_clients, serving, wait_until

pytestmark = pytest.mark.timeout(180)

CHUNK = 32
SYSTEM = "You are a coding agent. You read files, run tests and fix bugs. " * 6


def conversation(turns: int) -> list[dict[str, Any]]:
    """An OpenAI-style agent conversation: each turn adds a tool call and its result."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Why does test_parse fail?"},
    ]
    for turn in range(turns):
        call_id = f"call_{turn}"
        messages.append({"role": "assistant", "content": "", "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": "read", "arguments": f'{{"path": "m{turn}.py"}}'}}]})
        messages.append({"role": "tool", "tool_call_id": call_id, "content": f"def parse_{turn}(x):\n    return x + {turn}\n"})
    return messages


@pytest.fixture(scope="module")
def engine() -> Engine:
    return load_engine("default", options=EngineOptions(prefill_chunk=CHUNK, prefix_cache_mb=256))


@pytest.fixture(scope="module")
def server(engine: Engine) -> Iterator[ServerThread]:
    with serving(create_app(engine, ServerSettings())) as running:
        yield running


@pytest.fixture(scope="module")
def oa(server: ServerThread) -> openai.OpenAI:
    return sdk_clients(server, timeout=120)[0]


@pytest.fixture(scope="module")
def claude(server: ServerThread) -> anthropic.Anthropic:
    return sdk_clients(server, timeout=120)[1]


def full_blocks(tokens: int) -> int:
    return tokens // CHUNK * CHUNK


def test_chat_reports_cached_tokens_and_answers_as_without_cache(oa: openai.OpenAI, server: ServerThread) -> None:
    hits, misses = metric(server.url, "dflash_prefix_cache_hits_total"), metric(server.url, "dflash_prefix_cache_misses_total")
    first = oa.chat.completions.create(model="any", messages=conversation(1), max_tokens=6)
    assert first.usage is not None and first.usage.prompt_tokens_details is not None
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    second = oa.chat.completions.create(model="any", messages=conversation(2), max_tokens=6)
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    assert second.usage.prompt_tokens_details.cached_tokens == full_blocks(first.usage.prompt_tokens) > 0
    assert second.model_extra is not None and second.model_extra["timings"]["cache_n"] == full_blocks(first.usage.prompt_tokens)
    cold = oa.chat.completions.create(model="any", messages=conversation(2), max_tokens=6, extra_body={"cache_prompt": False})
    assert cold.usage is not None and cold.usage.prompt_tokens_details is not None
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert cold.choices[0].message.content == second.choices[0].message.content
    assert metric(server.url, "dflash_prefix_cache_hits_total") == hits + 1
    assert metric(server.url, "dflash_prefix_cache_misses_total") == misses + 1  # the opt-out is not a lookup
    assert metric(server.url, "dflash_prefix_cache_tokens") >= full_blocks(second.usage.prompt_tokens)
    assert metric(server.url, "dflash_prefix_cache_reused_tokens_total") >= full_blocks(first.usage.prompt_tokens)
    assert metric(server.url, "dflash_prefix_cache_budget_bytes") == 256 << 20


def test_streamed_chat_usage_carries_cached_tokens(oa: openai.OpenAI) -> None:
    stream = oa.chat.completions.create(model="any", messages=conversation(3), max_tokens=4, stream=True,
                                        stream_options={"include_usage": True})
    usage = [chunk.usage for chunk in stream if chunk.usage is not None]
    assert len(usage) == 1 and usage[0].prompt_tokens_details is not None
    assert usage[0].prompt_tokens_details.cached_tokens > 0


def test_header_opts_out_and_a_bad_value_is_refused(oa: openai.OpenAI) -> None:
    off = oa.chat.completions.create(model="any", messages=conversation(2), max_tokens=2,
                                     extra_headers={"X-DFlash-Prefix-Cache": "off"})
    assert off.usage is not None and off.usage.prompt_tokens_details is not None
    assert off.usage.prompt_tokens_details.cached_tokens == 0
    with pytest.raises(openai.BadRequestError, match="x-dflash-prefix-cache"):
        oa.chat.completions.create(model="any", messages=conversation(2), max_tokens=2,
                                   extra_headers={"X-DFlash-Prefix-Cache": "sometimes"})


def test_responses_usage_carries_cached_tokens(oa: openai.OpenAI) -> None:
    prompt = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Why does test_parse fail?"}]
    oa.responses.create(model="any", input=prompt, max_output_tokens=2)  # type: ignore[arg-type]
    again = oa.responses.create(model="any", input=[*prompt, {"role": "user", "content": "Look again."}],  # type: ignore[list-item]
                                max_output_tokens=2)
    assert again.usage is not None and again.usage.input_tokens_details.cached_tokens > 0


def test_anthropic_usage_splits_cached_and_uncached_input(claude: anthropic.Anthropic) -> None:
    turns: list[anthropic.types.MessageParam] = [{"role": "user", "content": "Why does test_parse fail?"}]
    claude.messages.create(model="any", system=SYSTEM, messages=turns, max_tokens=2)
    turns = [*turns, {"role": "assistant", "content": "Let me look."}, {"role": "user", "content": "Go on."}]
    whole = claude.messages.count_tokens(model="any", system=SYSTEM, messages=turns).input_tokens
    message = claude.messages.create(model="any", system=SYSTEM, messages=turns, max_tokens=2)
    assert message.usage.cache_read_input_tokens is not None and message.usage.cache_read_input_tokens > 0
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == whole
    with claude.messages.stream(model="any", system=SYSTEM, messages=turns, max_tokens=2) as stream:
        final = stream.get_final_message()  # the same prompt again: every full block but the last token's is cached
    assert final.usage.cache_read_input_tokens == full_blocks(whole - 1)
    assert final.usage.input_tokens == whole - full_blocks(whole - 1)


def message_start_and_final_usage(claude: anthropic.Anthropic, **params: Any) -> tuple[Any, Any]:
    """The usage a raw Anthropic stream reports in message_start and in its closing message_delta."""
    stream = claude.messages.create(model="any", max_tokens=2, stream=True, **params)
    events = list(stream)
    starts = [e for e in events if e.type == "message_start"]
    deltas = [e for e in events if e.type == "message_delta"]
    assert len(starts) == 1 and len(deltas) == 1 and events[0] is starts[0]
    return starts[0].message.usage, deltas[0].usage


def test_anthropic_message_start_reports_the_cached_read(claude: anthropic.Anthropic) -> None:
    """Before generating, the stream already splits the prompt into the cached read and the rest, as Anthropic
    does; the closing message_delta agrees with what the prefill actually restored."""
    turns: list[anthropic.types.MessageParam] = [{"role": "user", "content": "List the failing tests of the parser."}]
    whole = claude.messages.count_tokens(model="any", system=SYSTEM, messages=turns).input_tokens
    cold_start, cold_end = message_start_and_final_usage(
        claude, system=SYSTEM, messages=turns, extra_body={"cache_prompt": False})
    assert (cold_start.input_tokens, cold_start.cache_read_input_tokens) == (whole, 0)
    assert cold_end.cache_read_input_tokens == 0
    first_start, first_end = message_start_and_final_usage(claude, system=SYSTEM, messages=turns)
    assert first_start.input_tokens + (first_start.cache_read_input_tokens or 0) == whole
    assert first_start.cache_read_input_tokens == first_end.cache_read_input_tokens  # the system prompt's blocks
    again_start, again_end = message_start_and_final_usage(claude, system=SYSTEM, messages=turns)
    cached = full_blocks(whole - 1)  # every full block but the one holding the last token
    assert cached > 0
    assert (again_start.input_tokens, again_start.cache_read_input_tokens) == (whole - cached, cached)
    assert (again_end.input_tokens, again_end.cache_read_input_tokens) == (whole - cached, cached)
    off_start, off_end = message_start_and_final_usage(
        claude, system=SYSTEM, messages=turns, extra_headers={"X-DFlash-Prefix-Cache": "off"})
    assert (off_start.input_tokens, off_start.cache_read_input_tokens) == (whole, 0)
    assert off_end.cache_read_input_tokens == 0


def test_a_client_gone_mid_prefill_keeps_its_chunks_for_the_resend(server: ServerThread, engine: Engine) -> None:
    """A long prompt (about 100 prefill chunks: seconds of work even on a fast CPU, and within the cache's budget)
    is abandoned while it is being prefilled, as a client that times out does; the blocks its completed chunks cover
    are kept, and the same request sent again resumes from them."""
    assert engine.prefix_cache is not None
    words = " ".join(f"line {i}: value = compute({i}, {i * 7 % 13})" for i in range(200))
    messages = [{"role": "user", "content": f"Read this log and find the bug.\n{words}"}]
    blocks_before = engine.prefix_cache.stats().blocks
    cancelled = metric(server.url, "dflash_cancelled_total", api="chat", stage="running")
    body = {"model": "any", "messages": messages, "max_tokens": 2, "stream": True}
    done = threading.Event()

    def stream_then_leave() -> None:
        with httpx.Client(timeout=60) as client, client.stream("POST", f"{server.url}/v1/chat/completions", json=body):
            assert wait_until(lambda: metric(server.url, "dflash_busy") == 1.0, timeout=30)
            time.sleep(0.5)  # a few chunks into the prefill (seconds on this model)
        done.set()

    thread = threading.Thread(target=stream_then_leave)
    thread.start()
    thread.join(60)
    assert done.is_set()
    assert wait_until(lambda: metric(server.url, "dflash_cancelled_total", api="chat", stage="running") == cancelled + 1,
                      timeout=30)
    kept = engine.prefix_cache.stats().blocks - blocks_before
    follow = httpx.post(f"{server.url}/v1/chat/completions", json={**body, "stream": False, "max_tokens": 1}, timeout=120)
    usage = follow.json()["usage"]
    assert 0 < kept < usage["prompt_tokens"] // CHUNK  # cancelled inside the prefill, after some chunks
    assert usage["prompt_tokens_details"]["cached_tokens"] == kept * CHUNK
    assert engine.prefix_cache.stats().blocks == blocks_before + usage["prompt_tokens"] // CHUNK
