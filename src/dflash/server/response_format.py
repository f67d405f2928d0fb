"""Structured answers: chat `response_format` and Responses `text.format` of type `json_schema` or `json_object`.

The answer is held, token by token, to the JSON schema (`json_object`: any JSON object) through an llguidance
grammar that stays on to the end of the output: once the JSON value is complete only EOS is allowed. When the
turn also offers tools (tool choice `auto`), the model may instead open a call (`<tool_call>`); the rest of such
an output is free, so agents that ask for a typed final answer can still call their tools first.

A prompt that opens a reasoning block (`<think>` at the end of the template's generation prompt) is not
constrained: the grammar would forbid the reasoning.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from dflash.errors import GenerationError
from dflash.generation.constraints import TokenConstraint
from dflash.generation.grammar import FREE_TAIL
from dflash.server.errors import APIError
from dflash.server.tool_calls import OPEN

JSON_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True)
class AnswerSchema:
    """The JSON schema a request asks its answer to follow, and the parameter that asked (for errors)."""

    schema: dict[str, Any]
    param: str


class GrammarSource(Protocol):
    def grammar(self, lark: str, *, release: bool = True) -> TokenConstraint: ...


def chat_answer_schema(response_format: Mapping[str, Any] | None) -> AnswerSchema | None:
    """The schema a chat `response_format` asks for; None for plain text. Raises `APIError` (400)."""
    return _answer_schema(response_format, "response_format", nested="json_schema")


def responses_answer_schema(text: Any) -> AnswerSchema | None:
    """The schema a Responses `text` object (`{"format": {...}}`) asks for; None for plain text."""
    if text is None:
        return None
    if not isinstance(text, Mapping):
        raise APIError(400, "text must be an object such as {\"format\": {\"type\": \"text\"}}", param="text")
    return _answer_schema(text.get("format"), "text.format", nested=None)


def _answer_schema(spec: Any, param: str, *, nested: str | None) -> AnswerSchema | None:
    if spec is None:
        return None
    if not isinstance(spec, Mapping):
        raise APIError(400, f"{param} must be an object with a type", param=param)
    kind = spec.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return AnswerSchema(dict(JSON_OBJECT), param)
    if kind != "json_schema":
        raise APIError(
            400, f"{param} type {kind!r} is not supported (text, json_object or json_schema)",
            param=f"{param}.type", code="unsupported_parameter",
        )
    holder = spec.get(nested) if nested else spec  # chat nests {name, schema, strict}; Responses does not
    where = f"{param}.{nested}" if nested else param
    if not isinstance(holder, Mapping):
        raise APIError(400, f"{where} must be an object with the schema", param=where)
    schema = holder.get("schema", {})
    if not isinstance(schema, Mapping):
        raise APIError(400, f"{where}.schema must be a JSON schema object", param=f"{where}.schema")
    return AnswerSchema(dict(schema), param)


def answer_constraint(
    source: GrammarSource, schema: Mapping[str, Any], *, calls_allowed: bool, param: str = "response_format"
) -> TokenConstraint:
    """The whole answer as JSON following `schema` (or, with `calls_allowed`, a tool call). Raises `APIError`
    (400, naming `param`) for a schema that cannot be enforced."""
    rules = [f"answer: %json {json.dumps(schema)}"]
    if calls_allowed:
        rules = ["start: answer | call", *rules, f"call: {json.dumps(OPEN)} TAIL", f"TAIL: {FREE_TAIL}"]
    else:
        rules = ["start: answer", *rules]
    try:
        return source.grammar("\n".join([*rules, ""]), release=False)
    except GenerationError as exc:
        raise APIError(400, f"the {param} schema cannot be enforced: {exc}", param=param) from None
