"""The constraint of a forced tool call (`dflash.server.tool_constraint`) on the SmolLM2 vocabulary: offered names
only (JSON and XML formats), strict tools' arguments held to their JSON schema, clear 400s for schemas that
cannot be enforced; and end to end through the server with the real engine and the OpenAI SDK, where the model
left alone would name a tool that was never offered."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from functools import cache
from typing import Any

import httpx
import openai
import pytest

from dflash.engine.engine import Engine
from dflash.engine.loading import load_engine
from dflash.generation.constraint_factory import ConstraintFactory
from dflash.generation.constraints import ConstraintState, OneOfConstraint
from dflash.generation.request import GenerationRequest
from dflash.models.gguf_file import GGUFFile
from dflash.server import ServerSettings, create_app
from dflash.server.conversation import Message, ToolChoice, ToolSpec
from dflash.server.errors import APIError
from dflash.server.prompt import PromptBuilder
from dflash.server.tool_constraint import tool_constraint
from dflash.tokenizer import Tokenizer
from tests.loading_helpers import smollm2_path
from tests.server_helpers import ServerThread, sdk_clients, serving

REFUND_SCHEMA = {
    "type": "object",
    "properties": {"amount": {"type": "integer"}, "reason": {"type": "string", "enum": ["damaged", "late"]}},
    "required": ["amount", "reason"],
    "additionalProperties": False,
}
LOOKUP = ToolSpec("lookup_order_status", "Look up an order", {"type": "object", "properties": {"order_id": {"type": "string"}}})
REFUND = ToolSpec("issue_refund", "Refund an order", REFUND_SCHEMA, strict=True)


@cache
def smollm() -> Tokenizer:
    return Tokenizer.from_gguf_metadata(GGUFFile(smollm2_path()).metadata, source="smollm2")


@cache
def factory() -> ConstraintFactory:
    return ConstraintFactory(smollm(), 49152, smollm().eos_token_ids)


def feed(state: ConstraintState, text: str) -> bool:
    """Advance through the tokens of `text`; False at the first token the constraint refuses."""
    return all(state.allowed()[token] and state.advance(token) for token in smollm().encode(text))


# ---- names -----------------------------------------------------------------------------------------------------

def test_required_choice_restricts_names_in_each_format() -> None:
    plain = ToolSpec(REFUND.name, "", REFUND_SCHEMA)  # the same tool, not strict
    json_rule = tool_constraint(factory(), [LOOKUP, plain], ToolChoice("required"), "json")
    assert json_rule is not None
    assert not feed(json_rule.start(), 'get_weather"')  # a name never offered
    assert not feed(json_rule.start(), 'issue_refunds"')
    state = json_rule.start()
    assert feed(state, 'issue_refund", "arguments": ') and not state.finished
    xml_rule = tool_constraint(factory(), [LOOKUP, REFUND], ToolChoice("required"), "xml")
    assert isinstance(xml_rule, OneOfConstraint)  # strict arguments are not enforced in the XML format
    assert set(xml_rule.options) == {b"lookup_order_status>", b"issue_refund>"}
    state = xml_rule.start()
    assert feed(state, "issue_refund>\n<parameter=amount>") and state.finished


def test_no_constraint_when_nothing_is_forced() -> None:
    for choice in (ToolChoice("auto"), ToolChoice("none")):
        assert tool_constraint(factory(), [LOOKUP, REFUND], choice, "json") is None
    assert tool_constraint(factory(), [LOOKUP, REFUND], ToolChoice("named", LOOKUP.name), "xml") is None
    assert tool_constraint(factory(), [], ToolChoice("required"), "json") is None


# ---- strict arguments ------------------------------------------------------------------------------------------

def test_strict_tool_arguments_follow_the_schema() -> None:
    rule = tool_constraint(factory(), [LOOKUP, REFUND], ToolChoice("required"), "json")
    assert rule is not None and not isinstance(rule, OneOfConstraint)
    state = rule.start()
    assert not feed(rule.start(), 'get_weather", "arguments": {}}')  # a name never offered
    assert not feed(rule.start(), 'issue_refund", "arguments": {"amount": "12"')  # a string for an integer
    assert not feed(rule.start(), 'issue_refund", "arguments": {"amount": 12, "reason": "other"')  # not in the enum
    assert not feed(rule.start(), 'issue_refund", "arguments": {"amount": 12}}')  # a required key missing
    assert feed(state, 'issue_refund", "arguments": {"amount": 12, "reason": "late"')
    assert not state.finished
    assert feed(state, "}}\n</tool_call>") and state.finished


def test_a_non_strict_tools_arguments_are_any_json_object() -> None:
    """A forced call always parses: a tool without `strict` gets any JSON object as its arguments."""
    rule = tool_constraint(factory(), [LOOKUP, REFUND], ToolChoice("required"), "json")
    assert rule is not None
    assert not feed(rule.start(), 'lookup_order_status", "arguments": [1]')  # not an object
    assert not feed(rule.start(), 'lookup_order_status", "arguments": <function-name>')
    state = rule.start()
    assert feed(state, 'lookup_order_status", "arguments": {"anything": [1, {"goes": null}]') and not state.finished
    assert feed(state, "}}\n</tool_call>") and state.finished
    named = tool_constraint(factory(), [LOOKUP, REFUND], ToolChoice("named", LOOKUP.name), "json")
    assert named is not None
    assert not feed(named.start(), '"just text"')
    state = named.start()
    assert feed(state, '{"order_id": 7}}') and state.finished


def test_named_strict_tool_starts_at_its_arguments() -> None:
    rule = tool_constraint(factory(), [LOOKUP, REFUND], ToolChoice("named", REFUND.name), "json")
    assert rule is not None
    assert not feed(rule.start(), '{"amount": 1.5')
    assert not feed(rule.start(), '{"reason": "damaged"')  # keys come in the schema's order
    state = rule.start()
    assert feed(state, '{"amount": 3, "reason": "damaged"}') and not state.finished
    assert feed(state, "}") and state.finished


@pytest.mark.parametrize("schema", [
    {"type": "frobnicate"},
    {"type": "object", "properties": {"a": {"$ref": "#/definitions/missing"}}},
    {"type": "object", "properties": {"a": {"type": "string", "pattern": "(("}}},
])
def test_a_strict_schema_that_cannot_be_enforced_is_a_400(schema: dict[str, Any]) -> None:
    with pytest.raises(APIError) as caught:
        tool_constraint(factory(), [ToolSpec("broken", "", schema, strict=True)], ToolChoice("required"), "json")
    assert caught.value.status == 400 and caught.value.param == "tools" and "broken" in str(caught.value)


# ---- end to end ------------------------------------------------------------------------------------------------

QUESTION = [{"role": "user", "content": "What's the weather in Paris?"}]


@pytest.fixture(scope="module")
def engine() -> Engine:
    return load_engine("default")  # the default speculative mode (DDTree with the shipped drafter)


@pytest.fixture(scope="module")
def server(engine: Engine) -> Iterator[ServerThread]:
    with serving(create_app(engine, ServerSettings())) as running:
        yield running


ORDER_SCHEMA = {
    "type": "object", "properties": {"order_id": {"type": "string", "maxLength": 8}}, "required": ["order_id"],
    "additionalProperties": False,
}


def function(name: str, parameters: dict[str, Any], *, strict: bool) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": parameters, "strict": strict}}


@pytest.mark.timeout(300)
def test_required_choice_names_only_offered_tools(engine: Engine, server: ServerThread) -> None:
    """Left alone the model writes the name "Paris"; through the server the call names an offered tool (its
    arguments, free, are long: the answer is cut by max_tokens and the opening comes back as text)."""
    tools = [LOOKUP, ToolSpec(REFUND.name, REFUND.description, REFUND_SCHEMA)]
    prompt = PromptBuilder(engine).build([Message("user", QUESTION[0]["content"])], tools, ToolChoice("required"))
    alone = engine.generate(GenerationRequest(prompt.ids, max_new_tokens=3))
    assert alone.text.startswith("Paris"), alone.text

    client: openai.OpenAI = sdk_clients(server, timeout=240)[0]
    reply = client.chat.completions.create(
        model="any", messages=QUESTION, max_tokens=24, tool_choice="required",  # type: ignore[arg-type]
        tools=[function(t.name, t.parameters, strict=False) for t in tools],  # type: ignore[misc]
    )
    message = reply.choices[0].message
    named = [c.function.name for c in message.tool_calls or []]
    if not named:
        match = re.match(r'<tool_call>\n\{"name": "([^"]*)"', message.content or "")
        assert match, message.content
        named = [match.group(1)]
    assert named and set(named) <= {LOOKUP.name, REFUND.name}, named


@pytest.mark.timeout(300)
def test_required_choice_with_strict_tools_returns_a_complete_offered_call(server: ServerThread) -> None:
    client: openai.OpenAI = sdk_clients(server, timeout=240)[0]
    reply = client.chat.completions.create(
        model="any", messages=QUESTION, max_tokens=60, tool_choice="required",  # type: ignore[arg-type]
        tools=[function(LOOKUP.name, ORDER_SCHEMA, strict=True), function(REFUND.name, REFUND_SCHEMA, strict=True)],  # type: ignore[list-item]
    )
    calls = reply.choices[0].message.tool_calls
    assert calls, reply  # (the model may go on writing after the call, up to max_tokens)
    call = calls[0].function  # type: ignore[union-attr]
    arguments = json.loads(call.arguments)
    if call.name == LOOKUP.name:
        assert set(arguments) == {"order_id"} and len(arguments["order_id"]) <= 8
    else:
        assert call.name == REFUND.name and set(arguments) == {"amount", "reason"}


@pytest.mark.timeout(300)
def test_strict_named_tool_gets_arguments_that_follow_its_schema(server: ServerThread) -> None:
    reply = httpx.post(f"{server.url}/v1/chat/completions", timeout=240, json={
        "model": "any", "messages": QUESTION, "max_tokens": 40,
        "tools": [function(LOOKUP.name, LOOKUP.parameters, strict=False), function(REFUND.name, REFUND_SCHEMA, strict=True)],
        "tool_choice": {"type": "function", "function": {"name": REFUND.name}},
    }).json()
    call = reply["choices"][0]["message"]["tool_calls"][0]["function"]
    arguments = json.loads(call["arguments"])
    assert call["name"] == REFUND.name
    assert set(arguments) == {"amount", "reason"}
    assert isinstance(arguments["amount"], int) and arguments["reason"] in ("damaged", "late")


def test_an_unenforceable_strict_schema_is_an_openai_400(server: ServerThread) -> None:
    broken = {"type": "function", "function": {"name": "broken", "parameters": {"type": "frobnicate"}, "strict": True}}
    response = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
        "model": "any", "messages": QUESTION, "tools": [broken], "tool_choice": "required", "max_tokens": 4,
    })
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "tools" and "broken" in error["message"]


@pytest.mark.timeout(300)
def test_anthropic_any_choice_returns_a_tool_use_block(server: ServerThread) -> None:
    """`tool_choice: any` answers with a call to the offered tool whose input is an object: the schema's for a tool
    with `strict`, any object for one without (which the small model may still be writing when max_tokens ends the
    turn: then the call so far comes back as text, an object under way)."""
    claude = sdk_clients(server, timeout=240)[1]
    for strict in (True, False):
        tool: dict[str, Any] = {"name": REFUND.name, "description": REFUND.description, "input_schema": REFUND_SCHEMA}
        if strict:
            tool["strict"] = True
        message = claude.messages.create(
            model="any", max_tokens=80, messages=QUESTION, tools=[tool],  # type: ignore[list-item]
            tool_choice={"type": "any"},
        )
        uses = [block for block in message.content if block.type == "tool_use"]
        if not strict and not uses and message.stop_reason == "max_tokens":
            text = "".join(block.text for block in message.content if block.type == "text")
            assert text.startswith('<tool_call>\n{"name": "issue_refund", "arguments": {'), text
            continue
        assert uses, message.content
        assert uses[0].name == REFUND.name and isinstance(uses[0].input, dict)
        if strict:
            assert set(uses[0].input) == {"amount", "reason"}
            assert uses[0].input["reason"] in ("damaged", "late")
