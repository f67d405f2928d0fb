"""JSON answers: chat `response_format` and Responses `text.format` (`json_schema`, `json_object`) are enforced
token by token with the real engine (DDTree), with tool calls still possible when tools are offered; malformed
formats and schemas that cannot be enforced are 400s in the OpenAI error format."""

from __future__ import annotations

import json
from collections.abc import Iterator
from functools import cache
from typing import Any

import httpx
import openai
import pytest

from dflash.engine.engine import Engine
from dflash.engine.loading import load_engine
from dflash.generation.constraint_factory import ConstraintFactory
from dflash.generation.constraints import ConstraintState
from dflash.models.gguf_file import GGUFFile
from dflash.server import ServerSettings, create_app
from dflash.server.errors import APIError
from dflash.server.response_format import answer_constraint, chat_answer_schema, responses_answer_schema
from dflash.tokenizer import Tokenizer
from tests.loading_helpers import smollm2_path
from tests.server_helpers import ServerThread, sdk_clients, serving

pytestmark = pytest.mark.timeout(300)

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "sunny": {"type": "boolean"}},
    "required": ["city", "sunny"],
    "additionalProperties": False,
}
QUESTION = "What's the weather in Paris?"


@cache
def factory() -> ConstraintFactory:
    tokenizer = Tokenizer.from_gguf_metadata(GGUFFile(smollm2_path()).metadata, source="smollm2")
    return ConstraintFactory(tokenizer, 49152, tokenizer.eos_token_ids)


def feed(state: ConstraintState, text: str) -> bool:
    return all(state.allowed()[t] and state.advance(t) for t in factory().tokenizer.encode(text))


# ---- parsing the request ---------------------------------------------------------------------------------------

def test_formats_of_both_apis() -> None:
    assert chat_answer_schema(None) is None and chat_answer_schema({"type": "text"}) is None
    assert chat_answer_schema({"type": "json_object"}).schema == {"type": "object"}  # type: ignore[union-attr]
    chat = chat_answer_schema({"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}})
    assert chat is not None and chat.schema == WEATHER and chat.param == "response_format"
    responses = responses_answer_schema({"format": {"type": "json_schema", "name": "w", "schema": WEATHER}})
    assert responses is not None and responses.schema == WEATHER and responses.param == "text.format"
    assert responses_answer_schema({"verbosity": "low"}) is None  # no format: plain text


@pytest.mark.parametrize(("call", "param"), [
    (lambda: chat_answer_schema({"type": "yaml"}), "response_format.type"),
    (lambda: chat_answer_schema({"type": "json_schema"}), "response_format.json_schema"),
    (lambda: chat_answer_schema({"type": "json_schema", "json_schema": {"schema": [1]}}),
     "response_format.json_schema.schema"),
    (lambda: responses_answer_schema("json"), "text"),
    (lambda: responses_answer_schema({"format": {"type": "json_schema", "schema": "x"}}), "text.format.schema"),
])
def test_malformed_formats_are_400s(call: Any, param: str) -> None:
    with pytest.raises(APIError) as caught:
        call()
    assert caught.value.status == 400 and caught.value.param == param


def test_the_grammar_holds_the_whole_answer_and_lets_tools_be_called() -> None:
    answer_only = answer_constraint(factory(), WEATHER, calls_allowed=False)
    state = answer_only.start()
    assert feed(state, '{"city": "Paris", "sunny": true}')
    assert not state.finished  # stays on: only EOS may follow
    eos = factory().eos_ids[0]
    assert state.allowed().nonzero().squeeze(-1).tolist() == [eos]
    assert not feed(answer_only.start(), "Sure! Here is")
    assert not feed(answer_only.start(), '<tool_call>\n{"name": "f"')
    with_calls = answer_constraint(factory(), WEATHER, calls_allowed=True)
    calling = with_calls.start()
    assert feed(calling, '<tool_call>\n{"name": "anything", "arguments": {}}\n</tool_call>')
    assert feed(with_calls.start(), '{"city": "Rome", "sunny": false}')


# ---- end to end ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def engine() -> Engine:
    return load_engine("default")


@pytest.fixture(scope="module")
def server(engine: Engine) -> Iterator[ServerThread]:
    with serving(create_app(engine, ServerSettings())) as running:
        yield running


def check_weather(text: str) -> None:
    value = json.loads(text)
    assert set(value) == {"city", "sunny"} and isinstance(value["sunny"], bool) and len(value["city"]) <= 20


def test_chat_json_schema_answer(server: ServerThread) -> None:
    client: openai.OpenAI = sdk_clients(server, timeout=240)[0]
    reply = client.chat.completions.create(
        model="any", messages=[{"role": "user", "content": QUESTION}], max_tokens=40,
        response_format={"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER, "strict": True}},
    )
    assert reply.choices[0].finish_reason == "stop"
    check_weather(reply.choices[0].message.content or "")


def test_chat_json_object_answer(server: ServerThread) -> None:
    reply = httpx.post(f"{server.url}/v1/chat/completions", timeout=240, json={
        "model": "any", "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 60,
        "response_format": {"type": "json_object"},
    }).json()
    assert reply["choices"][0]["finish_reason"] == "stop"
    assert isinstance(json.loads(reply["choices"][0]["message"]["content"]), dict)


def test_responses_text_format_answer_and_echo(server: ServerThread) -> None:
    client: openai.OpenAI = sdk_clients(server, timeout=240)[0]
    response = client.responses.create(
        model="any", input=QUESTION, max_output_tokens=40,
        text={"format": {"type": "json_schema", "name": "weather", "schema": WEATHER, "strict": True}},
    )
    assert response.status == "completed"
    check_weather(response.output_text)
    assert response.text is not None and response.text.format.type == "json_schema"


def test_unenforceable_schemas_are_400s_in_each_api(server: ServerThread) -> None:
    broken = {"type": "frobnicate"}
    chat = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
        "model": "any", "messages": [{"role": "user", "content": "hi"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": broken}},
    })
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "response_format"
    responses = httpx.post(f"{server.url}/v1/responses", timeout=60, json={
        "model": "any", "input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": broken}},
    })
    assert responses.status_code == 400 and responses.json()["error"]["param"] == "text.format"
