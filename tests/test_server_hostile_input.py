"""Inputs that parse but used to reach code that cannot handle them: each is a 4xx in the API's own format, or is
handled, never a 500. Lone UTF-16 surrogates in any text field, JSON nested past any recursive consumer, token ids
outside the vocabulary, and sampling values inside the accepted ranges that overflow a computation."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import torch

from dflash.generation.sampling import SamplingParams, choose_tokens, filtered_probs
from dflash.server import ServerSettings, create_app
from dflash.server.body import MAX_JSON_DEPTH
from tests.server_helpers import FakeEngine, ServerThread, serving

pytestmark = pytest.mark.timeout(60)

SURROGATE = '"bad \\ud800 text"'  # a JSON escape of a lone high surrogate: valid JSON, not valid Unicode


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    with serving(create_app(FakeEngine(max_ctx=512), ServerSettings())) as running:
        yield running


def post_raw(server: ServerThread, path: str, text: str) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", content=text.encode(), headers={"content-type": "application/json"},
                      timeout=30)


def error_of(response: httpx.Response, path: str) -> dict[str, Any]:
    assert 400 <= response.status_code < 500, (response.status_code, response.text)
    body = response.json()
    if path.startswith("/v1/messages"):
        assert body["type"] == "error"
    return dict(body["error"])


SURROGATE_BODIES = [
    ("/v1/chat/completions", '{"model": "any", "messages": [{"role": "user", "content": %s}]}'),
    ("/v1/chat/completions", '{"model": "any", "messages": [{"role": "user", "content": "hi"}], "stop": [%s]}'),
    ("/v1/completions", '{"model": "any", "prompt": %s}'),
    ("/v1/responses", '{"model": "any", "input": %s}'),
    ("/v1/responses", '{"model": "any", "input": "hi", "instructions": %s}'),
    ("/v1/messages", '{"model": "any", "max_tokens": 5, "messages": [{"role": "user", "content": %s}]}'),
    ("/v1/messages", '{"model": "any", "max_tokens": 5, "system": %s, "messages": [{"role": "user", "content": "x"}]}'),
    ("/v1/messages/count_tokens", '{"model": "any", "messages": [{"role": "user", "content": %s}]}'),
    ("/v1/messages", '{"model": "any", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}], '
     '"tools": [{"name": "t", "input_schema": {"type": "object", %s: {}}}]}'),
]


@pytest.mark.parametrize(("path", "template"), SURROGATE_BODIES)
def test_lone_surrogates_are_400(server: ServerThread, path: str, template: str) -> None:
    error = error_of(post_raw(server, path, template % SURROGATE), path)
    assert "surrogate" in error["message"]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages", "/v1/responses", "/v1/completions"])
def test_nesting_past_the_parser_is_400(server: ServerThread, path: str) -> None:
    deep = '{"model": "any", "x": ' + "[" * 100_000 + "]" * 100_000 + "}"
    response = post_raw(server, path, deep)
    assert response.status_code == 400, response.text
    assert "nested" in error_of(response, path)["message"]


def test_nesting_past_the_depth_limit_is_400_naming_the_field(server: ServerThread) -> None:
    schema: Any = {}
    for _ in range(MAX_JSON_DEPTH + 5):
        schema = {"properties": schema}
    body = {"model": "any", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}],
            "tools": [{"name": "t", "input_schema": schema}]}
    response = httpx.post(f"{server.url}/v1/messages", json=body, timeout=30)
    error = error_of(response, "/v1/messages")
    assert "nested more than" in error["message"] and error["message"].startswith("tools.0.input_schema")


@pytest.mark.parametrize("ids", [[-1], [5, -7], [2**70], [2**63], [1_500_000]])
def test_token_ids_outside_the_vocabulary_are_400(server: ServerThread, ids: list[int]) -> None:
    for prompt in (ids, [ids]):
        response = httpx.post(f"{server.url}/v1/completions", json={"model": "any", "prompt": prompt}, timeout=30)
        error = error_of(response, "/v1/completions")
        assert error["param"].startswith("prompt"), error


@pytest.mark.parametrize(
    "sampling",
    [{"seed": 2**64}, {"seed": 2**200}, {"seed": -(2**70)}, {"temperature": 1e-40}, {"temperature": 5e-324},
     {"top_p": 1e-300}, {"top_p": 5e-324, "temperature": 1},
     {"temperature": 1e-40, "top_p": 1e-300, "seed": 2**64 + 1}],
)
def test_extreme_sampling_values_are_handled(server: ServerThread, sampling: dict[str, Any]) -> None:
    body = {"model": "any", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **sampling}
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 200, response.text
    claude = {k: v for k, v in body.items() if k != "seed"}
    response = httpx.post(f"{server.url}/v1/messages", json=claude, timeout=30)
    assert response.status_code == 200, response.text


def test_tiny_temperature_is_the_argmax_limit() -> None:
    logits = torch.tensor([[1.0, 30.0, 29.9, -5.0]])  # [rows, vocab]
    probs = filtered_probs(logits, SamplingParams(temperature=1e-40))
    assert torch.equal(probs, torch.tensor([[0.0, 1.0, 0.0, 0.0]]))
    # A tie at the top keeps both, as the limit of the softmax does.
    tied = filtered_probs(torch.tensor([[2.0, 2.0, 1.0]]), SamplingParams(temperature=1e-30))
    assert torch.allclose(tied, torch.tensor([[0.5, 0.5, 0.0]]))
    # The smallest positive double: 0 in float32, where the division happens.
    subnormal = filtered_probs(logits, SamplingParams(temperature=5e-324))
    assert torch.equal(subnormal, torch.tensor([[0.0, 1.0, 0.0, 0.0]]))


def test_top_p_below_float_precision_keeps_the_top_token() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0]])
    probs = filtered_probs(logits, SamplingParams(temperature=1.0, top_p=1e-300))
    assert torch.equal(probs, torch.tensor([[0.0, 1.0, 0.0]]))


def test_seeds_of_any_size_are_deterministic() -> None:
    logits = torch.randn(4, 50)
    for seed in (2**64, 2**64 + 7, -3, 2**200):
        params = SamplingParams(temperature=1.0, seed=seed)
        first = choose_tokens(logits, params, params.make_generator())
        again = choose_tokens(logits, params, params.make_generator())
        assert torch.equal(first, again)
    assert SamplingParams(temperature=1.0, seed=2**64 + 7).make_generator() is not None
