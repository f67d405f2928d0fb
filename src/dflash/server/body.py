"""Request bodies: size limit (413), JSON parsing (400 naming the problem), value checks every later step relies
on (nesting depth, well-formed Unicode: 400 naming the field) and schema validation (400 naming the field)."""

from __future__ import annotations

import json
import re
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect, Request

from dflash.server.errors import APIError

M = TypeVar("M", bound=BaseModel)

_DRAIN_LIMIT = 64 * 1024 * 1024  # an oversized body is read (and dropped) up to this, so the 413 is seen


async def read_json_object(request: Request, limit: int) -> dict[str, Any]:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        await _drain(request, int(declared))
        raise _too_large(int(declared), limit)
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > _DRAIN_LIMIT:
                break
            if size <= limit:
                chunks.append(chunk)
    except ClientDisconnect:
        raise APIError(400, "the client disconnected while sending the request body") from None
    if size > limit:  # the whole body was read (and dropped) so that the client sees the 413
        raise _too_large(size, limit, at_least=size > _DRAIN_LIMIT)
    raw = b"".join(chunks)
    if not raw.strip():
        raise APIError(400, "the request body is empty; expected a JSON object")
    try:
        data = json.loads(raw)
    except UnicodeDecodeError as exc:
        raise APIError(400, f"the request body is not UTF-8 text: {exc}") from None
    except ValueError as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise _too_deep("") from None
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, not {_json_type(data)}")
    check_json_values(data)
    return data


def check_json_values(data: Any) -> None:
    """Refuses (400) what JSON allows but no later step can handle: nesting deeper than `MAX_JSON_DEPTH` (every
    recursive consumer, from validation to the chat template, would fail on it) and strings or keys holding
    lone UTF-16 surrogates (`"\\ud800"` parses, but such text cannot be encoded, tokenised or written back).
    Iterative, so a hostile body cannot exhaust the stack here either."""
    stack: list[tuple[Any, str, int]] = [(data, "", 0)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, str):
            _check_text(value, path)
            continue
        if isinstance(value, dict):
            items: list[tuple[str, Any]] = list(value.items())
        elif isinstance(value, list):
            items = [(str(i), v) for i, v in enumerate(value)]
        else:
            continue
        if depth >= MAX_JSON_DEPTH:
            raise _too_deep(path)
        for key, child in items:
            child_path = f"{path}.{key}" if path else key
            if isinstance(value, dict):
                _check_text(key, child_path)
            stack.append((child, child_path, depth + 1))


MAX_JSON_DEPTH = 128  # tool schemas nest a few dozen levels at most


def _check_text(text: str, path: str) -> None:
    if _SURROGATE.search(text) is not None:
        where = path or "the request body"
        raise APIError(
            400, f"{where}: the text holds a lone UTF-16 surrogate (an unpaired \\uD800-\\uDFFF escape), which is "
            "not a Unicode character", param=path or None,
        )


_SURROGATE = re.compile("[\ud800-\udfff]")


def _too_deep(path: str) -> APIError:
    where = f"{path}: " if path else ""
    return APIError(400, f"{where}the request body is nested more than {MAX_JSON_DEPTH} levels deep", param=path or None)


def validate(model: type[M], data: Any, *, where: str = "") -> M:
    """`data` as a `model`; `where` prefixes field paths (e.g. "input.3" for one item of a list)."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc, where) from None


def validation_error(exc: ValidationError, where: str = "") -> APIError:
    problems = []
    first_loc: str | None = None
    for error in exc.errors()[:4]:
        loc = ".".join(p for p in (where, _location(error.get("loc", ()))) if p)
        first_loc = first_loc or loc
        message = str(error.get("msg", "invalid value"))
        problems.append(f"{loc}: {message}" if loc else message)
    more = len(exc.errors()) - len(problems)
    text = "; ".join(problems) + (f" (and {more} more)" if more > 0 else "")
    return APIError(400, f"invalid request: {text}", param=first_loc)


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "null", "is-instance"}


def _location(loc: tuple[Any, ...] | list[Any]) -> str:
    parts: list[str] = []
    for part in loc:
        if isinstance(part, int):
            parts.append(str(part))
            continue
        text = str(part)
        if "[" in text or text in _TYPE_TAGS or text.startswith("function-"):
            continue  # pydantic's union / validator branch tags, not field names
        parts.append(text)
    return ".".join(parts)


def _json_type(value: Any) -> str:
    if isinstance(value, list):
        return "an array"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    return "null"


def _too_large(size: int, limit: int, *, at_least: bool = False) -> APIError:
    prefix = "more than " if at_least else ""
    return APIError(
        413, f"the request body is {prefix}{size} bytes; the limit is {limit} bytes", kind="too_large",
        code="request_too_large",
    )


async def _drain(request: Request, seen: int) -> None:
    try:
        async for chunk in request.stream():
            seen += len(chunk)
            if seen > _DRAIN_LIMIT:
                return
    except (ClientDisconnect, RuntimeError):
        return
