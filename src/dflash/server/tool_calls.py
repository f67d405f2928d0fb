"""Tool calls in model output: the `<tool_call>` formats, argument coercion, and a streaming parser.

Formats inside `<tool_call>...</tool_call>`:
- JSON (Hermes / Qwen2.5 / Qwen3, and the fallback prompt this server injects for templates without tool
  support): `{"name": "f", "arguments": {...}}` (`parameters` is accepted for `arguments`).
- XML (Qwen3-Coder): `<function=f><parameter=k>v</parameter>...</function>`; values are text.

Arguments are coerced to the types the tool's JSON schema declares ("3" -> 3 for an integer, "true" -> True,
'[1, 2]' -> [1, 2] for an array...), since small models and the XML format produce strings.

`ToolCallStreamParser` splits streamed text into visible text and calls without ever releasing markup:
any tail that could still grow into `<tool_call>` is held back until it cannot.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from dflash.server.conversation import ToolCall, ToolChoice, ToolSpec

ToolFormat = Literal["json", "xml"]

OPEN = "<tool_call>"
CLOSE = "</tool_call>"

_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.DOTALL)


def call_opening(tool_format: ToolFormat, name: str | None) -> str:
    """The text that opens a call (to `name`, or to a tool the model names itself)."""
    if tool_format == "xml":
        return f"{OPEN}\n<function={name}>\n" if name else f"{OPEN}\n<function="
    if name:
        return f'{OPEN}\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": '
    return f'{OPEN}\n{{"name": "'


def forced_opening(choice: ToolChoice, tool_format: ToolFormat) -> str:
    """Prompt suffix that makes `tool_choice` required/named hold: the assistant turn starts with a call."""
    if choice.mode == "named":
        return call_opening(tool_format, choice.name)
    if choice.mode == "required":
        return call_opening(tool_format, None)
    return ""


def format_call_text(call: ToolCall) -> str:
    """A call written back into a prompt in the JSON format (for templates without tool support)."""
    arguments: Any = call.arguments if call.arguments is not None else call.raw_arguments
    body = json.dumps({"name": call.name, "arguments": arguments}, ensure_ascii=False)
    return f"{OPEN}\n{body}\n{CLOSE}"


# --------------------------------------------------------------------------------------------- parsing
def parse_call_body(body: str, tools: Mapping[str, ToolSpec]) -> ToolCall | None:
    """The text between `<tool_call>` and `</tool_call>` -> a call, or None when it is not one."""
    text = body.strip()
    if text.startswith("<function="):
        return _parse_xml(text, tools)
    if text.startswith("{"):
        return _parse_json(text, tools)
    return None


def _parse_json(text: str, tools: Mapping[str, ToolSpec]) -> ToolCall | None:
    try:
        value, _end = json.JSONDecoder().raw_decode(text)
    except ValueError:
        value = _close_json(text)
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    name = value["name"]
    raw = value.get("arguments", value.get("parameters", {}))
    raw_text = raw if isinstance(raw, str) else json.dumps(raw, ensure_ascii=False)
    if isinstance(raw, str):  # arguments encoded as a JSON string
        try:
            raw = json.loads(raw) if raw.strip() else {}
        except ValueError:
            return ToolCall(name=name, arguments=None, raw_arguments=raw_text)
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        return ToolCall(name=name, arguments=None, raw_arguments=raw_text)
    schema = tools[name].parameters if name in tools else {}
    return ToolCall(name=name, arguments=coerce_to_schema(raw, schema), raw_arguments=raw_text)


def _close_json(text: str) -> Any:
    """A JSON object cut short by missing closing braces (models stop early): try closing it."""
    for extra in ("}", "}}", "\"}", "\"}}"):
        try:
            return json.loads(text + extra)
        except ValueError:
            continue
    return None


def _parse_xml(text: str, tools: Mapping[str, ToolSpec]) -> ToolCall | None:
    match = _FUNCTION.search(text)
    if match is None:
        return None
    name = match.group(1).strip()
    if not name:
        return None
    arguments: dict[str, Any] = {}
    for param in _PARAMETER.finditer(match.group(2)):
        value = param.group(2)
        value = value[1:] if value.startswith("\n") else value
        value = value[:-1] if value.endswith("\n") else value
        arguments[param.group(1).strip()] = value
    schema = tools[name].parameters if name in tools else {}
    return ToolCall(name=name, arguments=coerce_to_schema(arguments, schema))


# -------------------------------------------------------------------------------------------- coercion
def coerce_to_schema(arguments: dict[str, Any], schema: Mapping[str, Any]) -> dict[str, Any]:
    properties = schema.get("properties") if isinstance(schema, Mapping) else None
    if not isinstance(properties, Mapping):
        return arguments
    return {
        key: coerce_value(value, properties[key]) if isinstance(properties.get(key), Mapping) else value
        for key, value in arguments.items()
    }


def _types_of(schema: Mapping[str, Any]) -> list[str]:
    declared = schema.get("type")
    if isinstance(declared, str):
        return [declared]
    if isinstance(declared, list):
        return [str(t) for t in declared]
    out: list[str] = []
    for key in ("anyOf", "oneOf"):
        for option in schema.get(key) or ():
            if isinstance(option, Mapping):
                out.extend(_types_of(option))
    return out


def coerce_value(value: Any, schema: Mapping[str, Any]) -> Any:
    """`value` converted to a type `schema` allows, when it is not one already and converts cleanly."""
    types = _types_of(schema)
    if not types or _matches(value, types):
        if isinstance(value, dict) and "object" in types:
            return coerce_to_schema(value, schema)
        if isinstance(value, list) and "array" in types and isinstance(schema.get("items"), Mapping):
            return [coerce_value(v, schema["items"]) for v in value]
        return value
    for kind in types:
        converted = _convert(value, kind)
        if converted is not _FAILED:
            return coerce_value(converted, schema) if kind in ("object", "array") else converted
    return value


def _matches(value: Any, types: Sequence[str]) -> bool:
    checks = {
        "string": lambda v: isinstance(v, str),
        "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
        "boolean": lambda v: isinstance(v, bool),
        "array": lambda v: isinstance(v, list),
        "object": lambda v: isinstance(v, dict),
        "null": lambda v: v is None,
    }
    return any(checks.get(t, lambda v: True)(value) for t in types)


_FAILED = object()
_INT = re.compile(r"[+-]?\d+")


def _convert(value: Any, kind: str) -> Any:
    if kind == "string":
        if isinstance(value, bool):
            return "true" if value else "false"
        if isinstance(value, int | float):
            return str(value)
        return json.dumps(value, ensure_ascii=False) if isinstance(value, dict | list) else _FAILED
    if kind == "integer":
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str) and _INT.fullmatch(value.strip()):
            return int(value.strip())
        if isinstance(value, str):
            number = _to_float(value)
            return int(number) if isinstance(number, float) and number.is_integer() else _FAILED
        return _FAILED
    if kind == "number":
        if isinstance(value, str):
            if _INT.fullmatch(value.strip()):
                return int(value.strip())
            return _to_float(value)
        return _FAILED
    if kind == "boolean":
        if isinstance(value, str) and value.strip().lower() in ("true", "false"):
            return value.strip().lower() == "true"
        return _FAILED
    if kind in ("array", "object"):
        if not isinstance(value, str):
            return _FAILED
        try:
            parsed = json.loads(value)
        except ValueError:
            return _FAILED
        return parsed if isinstance(parsed, list if kind == "array" else dict) else _FAILED
    if kind == "null":
        return None if isinstance(value, str) and value.strip().lower() in ("", "null", "none") else _FAILED
    return _FAILED


def _to_float(text: str) -> Any:
    try:
        number = float(text.strip())
    except ValueError:
        return _FAILED
    return number if number == number and abs(number) != float("inf") else _FAILED


# ------------------------------------------------------------------------------------------- streaming
Piece = str | ToolCall  # visible text, or a complete call


class ToolCallStreamParser:
    """Feed text as it is generated; get visible text and parsed calls, never partial markup."""

    def __init__(self, tools: Sequence[ToolSpec]) -> None:
        self.tools = {t.name: t for t in tools}
        self._buffer = ""
        self._in_call = False
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> list[Piece]:
        self._buffer += text
        out: list[Piece] = []
        while True:
            if not self._in_call:
                index = self._buffer.find(OPEN)
                if index >= 0:
                    if index:
                        out.append(self._buffer[:index])
                    self._buffer, self._in_call = self._buffer[index + len(OPEN) :], True
                    continue
                keep = _partial_suffix(self._buffer, OPEN)
                if len(self._buffer) > keep:
                    out.append(self._buffer[: len(self._buffer) - keep])
                    self._buffer = self._buffer[len(self._buffer) - keep :]
                return out
            index = self._buffer.find(CLOSE)
            if index < 0:
                return out
            body, self._buffer, self._in_call = self._buffer[:index], self._buffer[index + len(CLOSE) :], False
            out.append(self._call_or_text(body, closed=True))

    def finish(self) -> list[Piece]:
        """End of output: an unterminated call is parsed when it can be, otherwise returned as text."""
        rest, self._buffer = self._buffer, ""
        if self._in_call:
            self._in_call = False
            return [self._call_or_text(rest, closed=False)]
        return [rest] if rest else []

    def _call_or_text(self, body: str, *, closed: bool) -> Piece:
        call = parse_call_body(body, self.tools)
        # not a call after all, or one cut short before its name was complete: keep the text rather than lose it
        if call is None or (not closed and self.tools and call.name not in self.tools):
            return OPEN + body + (CLOSE if closed else "")
        self.calls.append(call)
        return call


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0
