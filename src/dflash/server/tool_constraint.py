"""The token constraint of a turn whose tool choice forces a call: only offered tools, strict arguments.

`tool_choice` required (OpenAI) / `any` (Anthropic) puts the opening of a call in the prompt
(`tool_calls.forced_opening`); the model then writes the name. Without a constraint it may name a tool that was
never offered, so the name is restricted to the offered ones, followed by the character that ends a name in the
format (JSON `"`, XML `>`). A named choice already puts the name in the prompt.

OpenAI function tools with `strict: true` must get arguments that follow their JSON schema. In the JSON call
format the name and the arguments are then one llguidance grammar: per tool, its name, and for a strict tool
`", "arguments": ` + the schema's JSON + the `}` that closes the call; after that the output is free again.
Strict arguments in the XML format (text parameters) and calls the model opens on its own (`auto`) are not
constrained.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Protocol

from dflash.errors import GenerationError
from dflash.generation.constraints import TokenConstraint
from dflash.generation.grammar import FREE_TAIL
from dflash.server.conversation import ToolChoice, ToolSpec
from dflash.server.errors import APIError
from dflash.server.tool_calls import ToolFormat

ARGUMENTS_KEY = ', "arguments": '  # between the name and the arguments, as `call_opening` writes it


class ConstraintSource(Protocol):
    """What the engine offers for building constraints (`dflash.generation.constraint_factory`)."""

    def one_of(self, options: Sequence[bytes]) -> TokenConstraint: ...

    def grammar(self, lark: str, *, release: bool = True) -> TokenConstraint: ...


def written_name(name: str, tool_format: ToolFormat) -> str:
    """The text the model writes for `name` after the forced opening, with the character that ends it."""
    if tool_format == "xml":
        return f"{name}>"
    return json.dumps(name, ensure_ascii=False)[1:]  # the JSON string's body and closing quote


def tool_constraint(
    source: ConstraintSource, tools: Sequence[ToolSpec], choice: ToolChoice, tool_format: ToolFormat
) -> TokenConstraint | None:
    """The constraint a turn needs, or None. Raises `APIError` (400) for a strict schema that cannot be used."""
    if not tools or choice.mode not in ("required", "named"):
        return None
    strict = tool_format == "json" and any(t.strict for t in tools)
    if choice.mode == "named":
        tool = next((t for t in tools if t.name == choice.name), None)
        if tool is None or not tool.strict or tool_format != "json":
            return None
        return _grammar(source, ['start: args0 "}" TAIL', _arguments_rule(0, tool)], tools)
    if not strict:
        return source.one_of([written_name(t.name, tool_format).encode() for t in tools])
    options, rules = [], []
    for i, tool in enumerate(tools):
        if tool.strict:
            options.append(f'{_literal(written_name(tool.name, "json") + ARGUMENTS_KEY)} args{i} "}}"')
            rules.append(_arguments_rule(i, tool))
        else:
            options.append(_literal(written_name(tool.name, "json")))
    return _grammar(source, ["start: call TAIL", f"call: {' | '.join(options)}", *rules], tools)


def _literal(text: str) -> str:
    return json.dumps(text)  # a Lark string literal (JSON escapes)


def _arguments_rule(index: int, tool: ToolSpec) -> str:
    schema = tool.parameters or {"type": "object"}
    return f"args{index}: %json {json.dumps(schema)}"


def _grammar(source: ConstraintSource, rules: list[str], tools: Sequence[ToolSpec]) -> TokenConstraint:
    try:
        return source.grammar("\n".join([*rules, f"TAIL: {FREE_TAIL}", ""]))
    except GenerationError as exc:
        names = ", ".join(t.name for t in tools if t.strict)
        raise APIError(
            400, f"the parameters schema of a strict tool ({names}) cannot be enforced: {exc}", param="tools",
        ) from None
