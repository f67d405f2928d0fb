"""`dflash serve` with the real default model (SmolLM2-135M, plain decoding) behind uvicorn, driven by the
official OpenAI and Anthropic SDKs: plain and streamed answers, usage and timings, disconnects, and eight
concurrent clients. Token budgets are small to keep the module fast on a CPU."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest

from dflash.engine.engine import Engine
from dflash.engine.loading import load_engine
from dflash.server import ServerSettings, create_app
from tests.server_helpers import ServerThread, metric, sdk_clients, serving, sse_events, wait_until

pytestmark = pytest.mark.timeout(120)

HI = [{"role": "user", "content": "Say hi"}]


@pytest.fixture(scope="module")
def engine() -> Engine:
    return load_engine("default", "none")


@pytest.fixture(scope="module")
def server(engine: Engine) -> Iterator[ServerThread]:
    with serving(create_app(engine, ServerSettings())) as running:
        yield running


@pytest.fixture(scope="module")
def oa(server: ServerThread) -> openai.OpenAI:
    return sdk_clients(server, timeout=60)[0]


@pytest.fixture(scope="module")
def claude(server: ServerThread) -> anthropic.Anthropic:
    return sdk_clients(server, timeout=60)[1]


@pytest.fixture(scope="module")
def reference(oa: openai.OpenAI) -> Any:
    """The non-streamed greedy answer to HI with 8 tokens (other tests compare against it)."""
    return oa.chat.completions.create(model="any", messages=HI, max_tokens=8)


def test_health_and_models(server: ServerThread, engine: Engine) -> None:
    health = httpx.get(f"{server.url}/health").json()
    assert health["status"] == "ok" and health["model"] == engine.model_name
    models = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x").models.list()
    assert [m.id for m in models.data] == [engine.model_name]
    assert "last_used_ms" in models.data[0].model_dump()


def test_chat_plain_usage_and_timings(reference: Any, engine: Engine) -> None:
    choice = reference.choices[0]
    assert choice.message.role == "assistant" and choice.message.content.strip()
    assert choice.finish_reason in ("stop", "length")
    usage = reference.usage
    assert usage.prompt_tokens == len(engine.chat_prompt_ids(HI))
    assert 0 < usage.completion_tokens <= 8
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens == 0
    timings = reference.model_extra["timings"]
    assert timings["prefill_ms"] > 0 and timings["decode_ms"] > 0
    assert timings["spec"] == "none"
    assert {"draft_tokens", "accepted_tokens", "acceptance_length"} <= timings.keys()


def test_chat_streaming_matches_plain(oa: openai.OpenAI, reference: Any) -> None:
    chunks = list(oa.chat.completions.create(
        model="any", messages=HI, max_tokens=8, stream=True, stream_options={"include_usage": True},
    ))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reference.choices[0].message.content  # greedy: streaming and plain agree exactly
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == reference.choices[0].finish_reason
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    assert usage_chunk.usage.completion_tokens == reference.usage.completion_tokens


def test_chat_stream_wire_format_ends_with_done(server: ServerThread) -> None:
    body = {"model": "any", "messages": HI, "max_tokens": 4, "stream": True}
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    events = sse_events(response.text)
    assert events[-1] == (None, "[DONE]")
    assert json.loads(events[-2][1])["choices"][0]["finish_reason"] in ("stop", "length")


def test_completions(oa: openai.OpenAI) -> None:
    result = oa.completions.create(model="any", prompt="The capital of France is", max_tokens=6)
    assert result.object == "text_completion" and result.choices[0].text
    assert result.choices[0].finish_reason in ("stop", "length")
    assert result.usage is not None and 0 < result.usage.completion_tokens <= 6


def test_anthropic_plain_and_stream(claude: anthropic.Anthropic, reference: Any) -> None:
    message = claude.messages.create(model="any", max_tokens=8, messages=HI)
    assert message.type == "message" and message.role == "assistant"
    assert message.content[0].type == "text"
    assert message.content[0].text == reference.choices[0].message.content  # same prompt, same greedy text
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert message.usage.input_tokens == reference.usage.prompt_tokens
    assert message.usage.output_tokens == reference.usage.completion_tokens
    with claude.messages.stream(model="any", max_tokens=8, messages=HI) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == message.content[0].text
    assert final.stop_reason == message.stop_reason and final.usage.output_tokens == message.usage.output_tokens


def test_anthropic_count_tokens(claude: anthropic.Anthropic, reference: Any) -> None:
    counted = claude.messages.count_tokens(model="any", messages=HI)
    assert counted.input_tokens == reference.usage.prompt_tokens


def test_responses_api(oa: openai.OpenAI, reference: Any) -> None:
    response = oa.responses.create(model="any", input="Say hi", max_output_tokens=8)
    assert response.output_text == reference.choices[0].message.content
    assert response.status in ("completed", "incomplete")
    assert response.usage is not None and response.usage.input_tokens == reference.usage.prompt_tokens


def _completion_tokens(url: str) -> float:
    return metric(url, "dflash_completion_tokens_total", api="chat")


def test_stream_disconnect_frees_the_worker(server: ServerThread, oa: openai.OpenAI) -> None:
    url = server.url
    cancelled_before = metric(url, "dflash_cancelled_total", api="chat", stage="running")
    tokens_before = _completion_tokens(url)
    body = {"model": "any", "messages": [{"role": "user", "content": "Tell me a very long story."}],
            "max_tokens": 400, "stream": True}
    with httpx.Client(timeout=60) as client, client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        seen = 0
        for line in response.iter_lines():
            if line.startswith("data:") and '"content"' in line:
                seen += 1
            if seen >= 3:
                break  # leaving the block closes the connection mid-stream
    assert wait_until(lambda: metric(url, "dflash_cancelled_total", api="chat", stage="running") == cancelled_before + 1)
    generated = _completion_tokens(url) - tokens_before
    assert generated < 100, f"the abandoned generation ran on for {generated} tokens"
    started = time.perf_counter()
    follow = oa.chat.completions.create(model="any", messages=HI, max_tokens=4)
    assert follow.choices[0].message.content
    assert time.perf_counter() - started < 15


def test_non_stream_disconnect_frees_the_worker(server: ServerThread, oa: openai.OpenAI) -> None:
    url = server.url
    cancelled_before = metric(url, "dflash_cancelled_total", api="chat", stage="running")
    tokens_before = _completion_tokens(url)
    # more tokens than the CPU decodes before the client gives up (1.5 s), whatever the machine's speed
    body = {"model": "any", "messages": [{"role": "user", "content": "Tell me a very long story."}], "max_tokens": 2000}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/chat/completions", json=body, timeout=httpx.Timeout(60, read=1.5))
    assert wait_until(lambda: metric(url, "dflash_cancelled_total", api="chat", stage="running") == cancelled_before + 1)
    # the request ended as cancelled (counted with its tokens when its generation stopped), well before its end
    assert _completion_tokens(url) - tokens_before < 2000
    follow = oa.chat.completions.create(model="any", messages=HI, max_tokens=4)
    assert follow.choices[0].message.content


def test_eight_concurrent_clients(server: ServerThread, oa: openai.OpenAI, engine: Engine, reference: Any) -> None:
    # Prompts of different lengths: each answer's usage must belong to its own prompt. Clients 0 and 7 send
    # the reference prompt: greedy decoding must reproduce the reference answer under load.
    prompts = [HI] + [[{"role": "user", "content": "Name a color. " * k}] for k in range(1, 7)] + [HI]
    results: list[Any] = [None] * len(prompts)
    errors: list[BaseException] = []

    def ask(i: int) -> None:
        try:
            results[i] = oa.chat.completions.create(model="any", messages=prompts[i], max_tokens=8)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    for messages, result in zip(prompts, results, strict=True):
        assert result.choices[0].message.content.strip()
        assert result.usage.prompt_tokens == len(engine.chat_prompt_ids(messages))
        assert 0 < result.usage.completion_tokens <= 8
    for i in (0, 7):
        assert results[i].choices[0].message.content == reference.choices[0].message.content
    assert len({r.id for r in results}) == len(prompts)


def test_metrics_after_traffic(server: ServerThread) -> None:
    url = server.url
    assert metric(url, "dflash_requests_total", api="chat", outcome="length") + metric(
        url, "dflash_requests_total", api="chat", outcome="stop") >= 10
    assert metric(url, "dflash_prompt_tokens_total", api="chat") > 0
    assert metric(url, "dflash_time_to_first_token_seconds_count", api="chat") >= 10
    assert metric(url, "dflash_request_latency_seconds_count", api="messages") >= 2
    assert metric(url, "dflash_http_requests_total", route="/v1/chat/completions", method="POST", status="200") >= 10
    assert metric(url, "dflash_queue_depth") == 0
    last_used = httpx.get(f"{url}/v1/models").json()["data"][0]["last_used_ms"]
    assert isinstance(last_used, int) and abs(last_used / 1000 - time.time()) < 120
