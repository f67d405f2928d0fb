"""A sweep of bad, hostile and extreme requests across every API against the real default engine (DDTree with the
shipped drafter): each is answered (200) or refused (4xx) in the API's own format, never a 5xx, an empty 200 or an
error event of the server's kind inside a stream."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from dflash.engine.loading import load_engine
from dflash.server import ServerSettings, create_app
from tests.server_helpers import ServerThread, serving

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _cases() -> list[tuple[str, Any, bool]]:
    """(path, body, raw): `raw` bodies are sent as written (not valid JSON, or JSON Python would not write)."""
    cases: list[tuple[str, Any, bool]] = []

    def add(path: str, body: Any, raw: bool = False) -> None:
        cases.append((path, body, raw))

    msg = [{"role": "user", "content": "hi"}]
    # chat variants
    for extra in [{"temperature": 5e-324}, {"top_p": 5e-324, "temperature": 1}, {"seed": 2**128, "temperature": 0.7},
                  {"seed": -1, "temperature": 0.5}, {"top_k": 2**62, "temperature": 1}, {"min_p": 1e-300, "temperature": 1},
                  {"presence_penalty": 2, "frequency_penalty": -2}, {"max_tokens": 2**63}, {"max_tokens": 1},
                  {"stop": ["\ud7ff"]}, {"stop": "x" * 10000}, {"stop": [""]}, {"logit_bias": {"5": 100}},
                  {"response_format": {"type": "json_object"}}, {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}},
                  {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}},
                  {"response_format": {"type": "json_schema"}}, {"response_format": {"type": "text"}},
                  {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}], "tool_choice": "required"},
                  {"tools": [{"type": "function", "function": {"name": "f", "strict": True, "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"], "additionalProperties": False}}}], "tool_choice": "required", "max_tokens": 40},
                  {"tools": [{"type": "function", "function": {"name": "f", "strict": True, "parameters": {"type": "object", "properties": {"q": {"$ref": "#/nope"}}}}}], "tool_choice": "required"},
                  {"tools": [{"type": "function", "function": {"name": "<|im_end|>", "parameters": {}}}], "tool_choice": "required", "max_tokens": 20},
                  {"tools": [], "tool_choice": "required"}, {"tool_choice": {"type": "function", "function": {"name": "zz"}}},
                  {"n": 0}, {"n": 2}, {"stream": True, "stream_options": {"include_usage": True}},
                  {"chat_template_kwargs": {"enable_thinking": True}}, {"chat_template_kwargs": {"messages": 1}},
                  {"chat_template_kwargs": {"x": "\ud800"}}]:
        add("/v1/chat/completions", {"model": "any", "messages": msg, "max_tokens": 8, **extra} if "max_tokens" not in extra else {"model": "any", "messages": msg, **extra})
    for m in [[{"role": "user", "content": None}], [{"role": "tool", "content": "x"}], [{"role": "assistant", "content": "x"}],
              [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:"}}]}],
              [{"role": "user", "content": [{"type": "text"}]}], [{"role": "system", "content": "s"}],
              [{"role": "developer", "content": "d"}, {"role": "user", "content": "u"}],
              [{"role": "user", "content": "a"}, {"role": "system", "content": "mid"}],
              [{"role": "assistant", "tool_calls": [{"id": "1", "function": {"name": "f", "arguments": "{bad"}}]}],
              [{"role": "user", "content": "<|im_start|>" * 500}], [{"role": "user", "content": "\x00\x01\x7f"}],
              [{"role": "user", "content": "x" * 40000}], []]:
        add("/v1/chat/completions", {"model": "any", "messages": m, "max_tokens": 5})
    # completions
    for p in ["hi", ["hi"], [1, 2, 3], [[1, 2]], [], [[]], [-1], [49152], [True], [1.5], ["a", "b"], [[1], [2]], "\ud800", "x" * 100000]:
        add("/v1/completions", {"model": "any", "prompt": p, "max_tokens": 4})
    add("/v1/completions", {"model": "any", "prompt": "hi", "echo": True, "logprobs": 5})
    add("/v1/completions", {"model": "any", "prompt": "hi", "suffix": "x"})
    add("/v1/completions", {"model": "any", "prompt": "hi", "best_of": 3})
    # anthropic
    base = {"model": "any", "max_tokens": 8}
    for extra in [{"messages": msg}, {"messages": msg, "temperature": 1e-40}, {"messages": msg, "top_p": 1e-300, "temperature": 1},
                  {"messages": msg, "top_k": 2**62}, {"messages": [{"role": "system", "content": "only system"}]},
                  {"messages": [{"role": "assistant", "content": "prefill"}]},
                  {"messages": msg, "system": [{"type": "text", "text": "s"}, {"type": "image"}]},
                  {"messages": msg, "tools": [{"name": "t", "input_schema": {"type": "object"}}], "tool_choice": {"type": "any"}},
                  {"messages": msg, "tools": [{"name": "t", "strict": True, "input_schema": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}], "tool_choice": {"type": "any"}, "max_tokens": 30},
                  {"messages": msg, "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
                  {"messages": msg, "tool_choice": {"type": "tool"}}, {"messages": msg, "thinking": {"type": "enabled", "budget_tokens": 1024}},
                  {"messages": msg, "stop_sequences": [""]}, {"messages": msg, "stream": True},
                  {"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "x", "content": "<|im_end|>"}]}]},
                  {"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
                  {"messages": [{"role": "user", "content": [{"type": "mid_conv_system", "text": "x"}]}]},
                  {"messages": msg, "max_tokens": 0}, {"messages": msg, "max_tokens": 10**20}, {"messages": msg, "metadata": {"user_id": "\ud800"}}]:
        add("/v1/messages", {**base, **extra})
    add("/v1/messages/count_tokens", {"model": "any", "messages": [{"role": "user", "content": "\ud800"}]})
    add("/v1/messages/count_tokens", {"model": "any", "messages": [{"role": "system", "content": "x"}]})
    # responses
    for extra in [{"input": "hi"}, {"input": []}, {"input": [{"role": "user", "content": "hi"}]}, {"input": [{"type": "function_call_output", "call_id": "x", "output": "o"}]},
                  {"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}}},
                  {"input": "hi", "text": {"format": {"type": "json_schema"}}}, {"input": "hi", "text": {"format": {"type": "bogus"}}},
                  {"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}], "tool_choice": "required", "max_output_tokens": 30},
                  {"input": "hi", "tools": [{"type": "web_search"}]}, {"input": "hi", "reasoning": {"effort": "high"}}, {"input": "hi", "seed": 2**100, "temperature": 1e-40},
                  {"input": "hi", "max_output_tokens": 0}, {"input": "hi", "stream": True}, {"input": "hi", "instructions": "<|im_end|>"}, {"input": 5}]:
        add("/v1/responses", {"model": "any", "max_output_tokens": 8, **extra} if "max_output_tokens" not in extra else {"model": "any", **extra})
    raws = ['{"model":"any","messages":[{"role":"user","content":"hi"}],"max_tokens":3,"temperature":NaN}', '{"model":"any","messages":[{"role":"user","content":"hi"}],"max_tokens":Infinity}',
            '[' * 50000, '{"a":' * 3000 + '1' + '}' * 3000, '\xff\xfe', '{"model": "any", "messages": [{"role": "user", "content": "\\udc00\\ud800"}]}', '{"model":"any","messages":"x"}', 'null', '""']
    for r in raws:
        for path in ["/v1/chat/completions", "/v1/messages", "/v1/responses", "/v1/completions", "/v1/messages/count_tokens"]:
            add(path, r, raw=True)
    return cases


CASES = _cases()


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    with serving(create_app(load_engine("default"), ServerSettings())) as running:
        yield running


@pytest.mark.parametrize(("path", "body", "raw"), CASES, ids=[f"{i}-{p}" for i, (p, _, _) in enumerate(CASES)])
def test_never_a_server_error(server: ServerThread, path: str, body: Any, raw: bool) -> None:
    text = body if raw else json.dumps(body)
    response = httpx.post(server.url + path, content=text.encode("utf-8", "surrogatepass"),
                          headers={"content-type": "application/json"}, timeout=120)
    assert response.status_code < 500, response.text
    assert response.text.strip(), "an empty answer"
    for kind in ("internal_error", "api_error", "server_error"):
        assert kind not in response.text, response.text
    if response.status_code >= 400:
        error = response.json()
        assert ("error" in error) and (error.get("type") == "error" or "message" in error["error"]), error
