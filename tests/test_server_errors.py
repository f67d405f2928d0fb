"""Bad input is a 4xx naming the problem, in the called API's own error format; engine failures are 500s
(or error events in a stream), logged and counted, never reported as cancellations."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest

from dflash.errors import GenerationError
from dflash.server import ServerSettings, create_app
from tests.server_helpers import (
    FakeEngine,
    ServerThread,
    metric,
    sdk_clients,
    serving,
    sse_events,
    wait_until,
)

pytestmark = pytest.mark.timeout(60)

ASK = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def fake() -> FakeEngine:
    return FakeEngine(max_ctx=512)


@pytest.fixture(scope="module")
def server(fake: FakeEngine) -> Iterator[ServerThread]:
    with serving(create_app(fake, ServerSettings(max_body_bytes=64 * 1024))) as running:
        yield running


@pytest.fixture(autouse=True)
def fresh(fake: FakeEngine) -> Iterator[None]:
    fake.outputs.clear()
    yield
    fake.fail_with, fake.fail_after, fake.fail_once_stopped, fake.token_delay = None, 0, False, 0.0


def post(server: ServerThread, path: str, body: Any, **kwargs: Any) -> httpx.Response:
    if isinstance(body, bytes | str):
        return httpx.post(f"{server.url}{path}", content=body, headers={"content-type": "application/json"},
                          timeout=30, **kwargs)
    return httpx.post(f"{server.url}{path}", json=body, timeout=30, **kwargs)


def openai_error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return dict(error)


def anthropic_error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
    return dict(body["error"])


# ------------------------------------------------------------------------------------------ bodies
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/responses"])
def test_malformed_json_openai_apis(server: ServerThread, path: str) -> None:
    error = openai_error(post(server, path, b'{"model": "any", "messages": ['), 400)
    assert "not valid JSON" in error["message"] and error["type"] == "invalid_request_error"


def test_malformed_json_anthropic(server: ServerThread) -> None:
    error = anthropic_error(post(server, "/v1/messages", b"{nope"), 400)
    assert error["type"] == "invalid_request_error" and "not valid JSON" in error["message"]


def test_body_must_be_an_object(server: ServerThread) -> None:
    assert "must be a JSON object, not an array" in openai_error(post(server, "/v1/chat/completions", [1, 2]), 400)["message"]
    assert "empty" in openai_error(post(server, "/v1/chat/completions", b""), 400)["message"]


@pytest.mark.parametrize(("body", "field"), [
    ({"model": "any", "messages": "hello"}, "messages"),
    ({"model": "any", "messages": []}, "messages"),
    ({"model": "any"}, "messages"),
    ({"model": "any", "messages": ASK, "max_tokens": "ten"}, "max_tokens"),
    ({"model": "any", "messages": ASK, "max_tokens": 0}, "max_tokens"),
    ({"model": "any", "messages": ASK, "temperature": 5}, "temperature"),
    ({"model": "any", "messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ({"model": "any", "messages": [{"role": "user"}]}, "messages.0.content"),
    ({"model": "any", "messages": ASK, "tools": [{"type": "function", "function": {"name": ""}}]}, "tools.0.function.name"),
    ({"model": "any", "messages": ASK, "stream": "yes please"}, "stream"),
])
def test_wrong_types_name_the_field(server: ServerThread, body: dict[str, Any], field: str) -> None:
    error = openai_error(post(server, "/v1/chat/completions", body), 400)
    assert field in error["message"], error["message"]


def test_unsupported_content_and_tool_choice(server: ServerThread) -> None:
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]
    error = openai_error(post(server, "/v1/chat/completions", {"model": "any", "messages": image}), 400)
    assert "'image_url'" in error["message"] and "messages.0.content.0" in error["message"]
    body = {"model": "any", "messages": ASK, "tool_choice": {"type": "function", "function": {"name": "nope"}},
            "tools": [{"type": "function", "function": {"name": "real"}}]}
    error = openai_error(post(server, "/v1/chat/completions", body), 400)
    assert "'nope'" in error["message"] and error["param"] == "tool_choice"
    error = openai_error(post(server, "/v1/chat/completions", {"model": "any", "messages": ASK, "tool_choice": "required"}), 400)
    assert "needs at least one tool" in error["message"]


def test_unknown_fields_are_accepted_in_openai_chat(server: ServerThread) -> None:
    body = {"model": "any", "messages": ASK, "max_tokens": 5, "store": True, "some_vendor_flag": {"x": 1}}
    assert post(server, "/v1/chat/completions", body).status_code == 200


def test_anthropic_validation(server: ServerThread) -> None:
    error = anthropic_error(post(server, "/v1/messages", {"model": "any", "messages": ASK}), 400)
    assert "max_tokens" in error["message"] and "Field required" in error["message"]
    blocks = [{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "data": "x"}}]}]
    error = anthropic_error(post(server, "/v1/messages", {"model": "any", "max_tokens": 5, "messages": blocks}), 400)
    assert "image blocks are not supported" in error["message"]
    bad_block = [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "x"}]}]
    error = anthropic_error(post(server, "/v1/messages", {"model": "any", "max_tokens": 5, "messages": bad_block}), 400)
    assert "input" in error["message"]


def test_responses_validation(server: ServerThread) -> None:
    body = {"model": "any", "input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}
    error = openai_error(post(server, "/v1/responses", body), 400)
    assert "input.0.call_id" in error["message"]
    body = {"model": "any", "input": [{"type": "computer_call", "id": "x"}]}
    assert "'computer_call'" in openai_error(post(server, "/v1/responses", body), 400)["message"]
    body = {"model": "any", "input": "hi", "previous_response_id": "resp_1"}
    assert openai_error(post(server, "/v1/responses", body), 400)["param"] == "previous_response_id"


def test_oversized_body_is_413(server: ServerThread) -> None:
    big = {"model": "any", "messages": [{"role": "user", "content": "x" * 100_000}]}
    error = openai_error(post(server, "/v1/chat/completions", big), 413)
    assert "limit is 65536 bytes" in error["message"]
    big["max_tokens"] = 5
    error = anthropic_error(post(server, "/v1/messages", big), 413)
    assert error["type"] == "request_too_large"


# ------------------------------------------------------------------------------------------ budget
def test_context_overflow_uses_each_apis_words(server: ServerThread) -> None:
    """Clients act on these words: Claude Code retries with a smaller max_tokens on Anthropic's "input length and
    `max_tokens` exceed context limit: A + B > C" and compacts on "prompt is too long"; LiteLLM/aider read
    "maximum context length is"; OpenAI clients read the code context_length_exceeded."""
    error = openai_error(post(server, "/v1/chat/completions", {"model": "any", "messages": ASK, "max_tokens": 600}), 400)
    assert "This model's maximum context length is 512 tokens" in error["message"]
    assert error["code"] == "context_length_exceeded" and error["param"] == "max_tokens"
    prompt = len(FakeEngine().tokenizer.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"))
    error = anthropic_error(post(server, "/v1/messages", {"model": "any", "messages": ASK, "max_tokens": 600}), 400)
    assert error["type"] == "invalid_request_error"
    assert re.search(r"input length and `max_tokens` exceed context limit: (\d+) \+ (\d+) > (\d+)", error["message"])
    assert f"{prompt} + 600 > 512" in error["message"]
    long_prompt = {"model": "any", "messages": [{"role": "user", "content": "y" * 600}], "max_tokens": 10}
    error = anthropic_error(post(server, "/v1/messages", long_prompt), 400)
    assert re.match(r"prompt is too long: \d+ tokens > 511 maximum", error["message"])
    error = openai_error(post(server, "/v1/chat/completions", long_prompt), 400)
    assert "maximum context length is 512 tokens" in error["message"] and error["param"] == "messages"
    assert error["code"] == "context_length_exceeded"
    error = openai_error(post(server, "/v1/completions", {"model": "any", "prompt": "z" * 600}), 400)
    assert error["code"] == "context_length_exceeded" and error["param"] == "prompt"
    error = openai_error(post(server, "/v1/responses", {"model": "any", "input": "hi", "max_output_tokens": 900}), 400)
    assert error["code"] == "context_length_exceeded" and error["param"] == "input"
    assert "exceeds the context window" in error["message"] and "maximum context length is 512" in error["message"]


def test_context_overflow_through_the_sdks(server: ServerThread) -> None:
    oa, claude = sdk_clients(server)
    with pytest.raises(anthropic.BadRequestError, match="exceed context limit"):
        claude.messages.create(model="any", max_tokens=32000, messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError) as info:
        oa.chat.completions.create(model="any", max_tokens=32000, messages=[{"role": "user", "content": "hi"}])
    assert info.value.code == "context_length_exceeded"


def test_clamp_max_tokens_setting() -> None:
    engine = FakeEngine(max_ctx=512)
    with serving(create_app(engine, ServerSettings(clamp_max_tokens=True))) as running:
        body = {"model": "any", "max_tokens": 32000, "messages": ASK}
        message = httpx.post(f"{running.url}/v1/messages", json=body, timeout=30).json()
    assert message["stop_reason"] == "end_turn"
    assert engine.requests[0].max_new_tokens == 512 - len(engine.requests[0].prompt_ids)


def test_engine_generation_error_is_400(server: ServerThread, fake: FakeEngine) -> None:
    fake.fail_with = GenerationError("top_p must be in (0, 1], got 7")
    error = openai_error(post(server, "/v1/chat/completions", {"model": "any", "messages": ASK}), 400)
    assert error["message"] == "top_p must be in (0, 1], got 7"


def test_n_greater_than_one_is_refused(server: ServerThread) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="any", messages=ASK, n=2)
    assert "n=2 is not supported" in str(info.value)
    assert openai_error(post(server, "/v1/completions", {"model": "any", "prompt": "x", "n": 3}), 400)["param"] == "n"


def test_unknown_model_is_404(server: ServerThread) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-7", messages=ASK)
    assert "'gpt-7' does not exist" in str(info.value)
    claude = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0)
    with pytest.raises(anthropic.NotFoundError) as info_a:
        claude.messages.create(model="claude-9", max_tokens=5, messages=ASK)
    assert info_a.value.body["error"]["type"] == "not_found_error"
    for name in ("any", "", "fake-model"):
        assert post(server, "/v1/chat/completions", {"model": name, "messages": ASK, "max_tokens": 3}).status_code == 200


def test_unknown_route_is_404_in_api_format(server: ServerThread) -> None:
    error = openai_error(httpx.get(f"{server.url}/v1/nothing"), 404)
    assert "no route GET /v1/nothing" in error["message"]


# ------------------------------------------------------------------------------------------ api key
def test_api_key() -> None:
    with serving(create_app(FakeEngine(), ServerSettings(api_key="sekret"))) as running:
        url = running.url
        body = {"model": "any", "messages": ASK, "max_tokens": 3}
        error = openai_error(httpx.post(f"{url}/v1/chat/completions", json=body), 401)
        assert "missing API key" in error["message"] and error["code"] == "invalid_api_key"
        error = openai_error(httpx.post(f"{url}/v1/chat/completions", json=body, headers={"Authorization": "Bearer no"}), 401)
        assert error["message"] == "invalid API key"
        error = anthropic_error(httpx.post(f"{url}/v1/messages", json=body, headers={"x-api-key": "no"}), 401)
        assert error["type"] == "authentication_error"
        assert httpx.get(f"{url}/health").status_code == 200  # probes stay open
        good = openai.OpenAI(base_url=f"{url}/v1", api_key="sekret", max_retries=0)
        assert good.chat.completions.create(model="any", messages=ASK, max_tokens=3).choices[0].message.content
        claude = anthropic.Anthropic(base_url=url, api_key="sekret", max_retries=0)  # sends x-api-key
        assert claude.messages.create(model="any", max_tokens=3, messages=ASK).content
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()


# ------------------------------------------------------------------------------------------ failures
def test_engine_failure_is_500_not_cancellation(server: ServerThread, fake: FakeEngine) -> None:
    url = server.url
    errors, cancelled = metric(url, "dflash_generation_errors_total", api="chat"), metric(url, "dflash_cancelled_total", api="chat", stage="running")
    fake.fail_with, fake.fail_after = RuntimeError("CUDA exploded"), 3
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.InternalServerError) as info:
        client.chat.completions.create(model="any", messages=ASK)
    assert info.value.status_code == 500 and "RuntimeError: CUDA exploded" in str(info.value)
    assert metric(url, "dflash_generation_errors_total", api="chat") == errors + 1
    assert metric(url, "dflash_cancelled_total", api="chat", stage="running") == cancelled
    assert metric(url, "dflash_requests_total", api="chat", outcome="error") >= 1
    fake.fail_with = None
    assert client.chat.completions.create(model="any", messages=ASK).choices[0].message.content


def test_failure_after_client_left_is_still_an_error(server: ServerThread, fake: FakeEngine) -> None:
    url = server.url
    errors, cancelled = metric(url, "dflash_generation_errors_total", api="chat"), metric(url, "dflash_cancelled_total", api="chat", stage="running")
    fake.fail_with, fake.fail_once_stopped, fake.token_delay = RuntimeError("died while stopping"), True, 0.02
    fake.script("z" * 1000)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/chat/completions", json={"model": "any", "messages": ASK},
                   timeout=httpx.Timeout(30, read=0.5))
    assert wait_until(lambda: metric(url, "dflash_generation_errors_total", api="chat") == errors + 1)
    assert metric(url, "dflash_cancelled_total", api="chat", stage="running") == cancelled


def test_stream_failure_is_an_error_event(server: ServerThread, fake: FakeEngine) -> None:
    fake.fail_with, fake.fail_after = RuntimeError("kernel panic"), 5
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    received = []
    with pytest.raises(openai.APIError) as info:
        for chunk in client.chat.completions.create(model="any", messages=ASK, stream=True):
            received.append(chunk)
    assert "kernel panic" in str(info.value)
    assert "".join(c.choices[0].delta.content or "" for c in received if c.choices) == fake.default[:5]

    body = {"model": "any", "max_tokens": 50, "stream": True, "messages": ASK}
    events = sse_events(post(server, "/v1/messages", body).text)
    assert events[-1][0] == "error"
    assert json.loads(events[-1][1])["error"] == {"type": "api_error", "message": "generation failed: RuntimeError: kernel panic"}
    events = sse_events(post(server, "/v1/responses", {"model": "any", "input": "x", "stream": True}).text)
    assert events[-1][0] == "response.failed"
    assert "kernel panic" in json.loads(events[-1][1])["response"]["error"]["message"]


def test_a_base_model_without_a_chat_template_serves_completions_and_refuses_chats() -> None:
    """A model whose tokenizer has no chat template (a base model such as `--model gemma3-270m`): chat requests of
    every API are a 400 that says to use completions, in each API's own error format; completions are served."""
    from tests.server_helpers import CharTokenizer

    base = FakeEngine(max_ctx=512, tokenizer=CharTokenizer(chat_template=None), default="continued text")
    with serving(create_app(base, ServerSettings())) as running:
        error = openai_error(post(running, "/v1/chat/completions", {"model": "any", "messages": ASK}), 400)
        assert error["code"] == "no_chat_template" and "/v1/completions" in error["message"]
        error = anthropic_error(
            post(running, "/v1/messages", {"model": "any", "max_tokens": 8, "messages": ASK}), 400
        )
        assert error["type"] == "invalid_request_error" and "/v1/completions" in error["message"]
        openai_error(post(running, "/v1/responses", {"model": "any", "input": "hi"}), 400)
        assert base.requests == []  # nothing reached the engine
        done = post(running, "/v1/completions", {"model": "any", "prompt": "def f(x):", "max_tokens": 20})
        assert done.status_code == 200, done.text
        assert done.json()["choices"][0]["text"] == "continued text" and base.prompts == ["def f(x):"]
