"""The token constraint of a turn whose tool choice forces a call: only offered tools, strict arguments.

`tool_choice` required (OpenAI) / `any` (Anthropic) puts the opening of a call in the prompt
(`tool_calls.forced_opening`); the model then writes the name. Without a constraint it may name a tool that was
never offered, so the name is restricted to the offered ones, followed by the character that ends a name in the
format (JSON `"`, XML `>`). A named choice already puts the name in the prompt.

In the JSON call format the name and the arguments are one llguidance grammar: per tool, its name,
`", "arguments": `, the arguments and the `}` that closes the call; after that the output is free again. The
arguments of a tool with `strict: true` follow its JSON schema; those of any other tool are at least a JSON object,
so a forced call always parses as a call. The XML format (text parameters) constrains the name only, and calls the
model opens on its own (`auto`) are not constrained.
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
    if tool_format == "xml":
        if choice.mode == "named":
            return None  # the name is in the prompt already
        return source.one_of([written_name(t.name, tool_format).encode() for t in tools])
    if choice.mode == "named":
        tool = next((t for t in tools if t.name == choice.name), None)
        if tool is None:
            return None
        return _grammar(source, ['start: args0 "}" TAIL', _arguments_rule(0, tool)], tools)
    options = [f'{_literal(written_name(t.name, "json") + ARGUMENTS_KEY)} args{i} "}}"' for i, t in enumerate(tools)]
    rules = [_arguments_rule(i, t) for i, t in enumerate(tools)]
    return _grammar(source, ["start: call TAIL", f"call: {' | '.join(options)}", *rules], tools)


def _literal(text: str) -> str:
    return json.dumps(text)  # a Lark string literal (JSON escapes)


def _arguments_rule(index: int, tool: ToolSpec) -> str:
    schema = (tool.parameters or _ANY_OBJECT) if tool.strict else _ANY_OBJECT
    return f"args{index}: %json {json.dumps(schema)}"


_ANY_OBJECT = {"type": "object"}  # the arguments of a tool without `strict`: any JSON object


def _grammar(source: ConstraintSource, rules: list[str], tools: Sequence[ToolSpec]) -> TokenConstraint:
    try:
        return source.grammar("\n".join([*rules, f"TAIL: {FREE_TAIL}", ""]))
    except GenerationError as exc:
        names = ", ".join(t.name for t in tools if t.strict) or ", ".join(t.name for t in tools)
        raise APIError(
            400, f"the parameters schema of a strict tool ({names}) cannot be enforced: {exc}", param="tools",
        ) from None
