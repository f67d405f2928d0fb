"""Rendering of Hugging Face-convention chat templates (Jinja2, sandboxed).

A chat template turns a list of messages into the exact prompt text a model was trained on. Templates
come from `tokenizer_config.json`, `chat_template.jinja` or GGUF metadata and are untrusted input, so
they run in Jinja2's immutable sandbox. The environment offers what templates written for
transformers expect: `raise_exception`, `strftime_now`, a `tojson` filter that keeps non-ASCII text,
the `loopcontrols` extension and a no-op `{% generation %}` block.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.parser import Parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

from dflash.errors import GenerationError

__all__ = ["render_chat_template"]


class TemplateRaisedError(Exception):
    """Raised by `raise_exception(...)` inside a template."""


def _raise_exception(message: str) -> None:
    raise TemplateRaisedError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(
    value: Any,
    indent: int | str | None = None,
    ensure_ascii: bool = False,
    separators: Sequence[str] | None = None,
    sort_keys: bool = False,
) -> str:
    seps = (str(separators[0]), str(separators[1])) if separators is not None else None
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, separators=seps, sort_keys=sort_keys)


class _GenerationBlock(Extension):
    """Accepts `{% generation %}...{% endgeneration %}` (used for assistant masks) and renders the body."""

    tags = {"generation"}  # noqa: RUF012 (jinja2 declares it a plain set)

    def parse(self, parser: Parser) -> list[nodes.Node]:
        next(parser.stream)  # the `generation` name token
        return list(parser.parse_statements(("name:endgeneration",), drop_needle=True))


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=["jinja2.ext.loopcontrols", _GenerationBlock],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


_ENV = _environment()


@lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    try:
        return _ENV.from_string(template)
    except jinja2.TemplateSyntaxError as exc:
        raise GenerationError(
            f"chat template has a syntax error at line {exc.lineno}: {exc.message}"
        ) from None


def render_chat_template(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    bos_token: str | None = None,
    eos_token: str | None = None,
    **template_kwargs: Any,
) -> str:
    """Render `template` for `messages`; extra keyword arguments (e.g. `enable_thinking`) become variables.

    Raises `GenerationError` when the template cannot be compiled, raises through `raise_exception`,
    or fails while rendering.
    """
    compiled = _compile(template)
    variables: dict[str, Any] = {
        **template_kwargs,
        "messages": [dict(m) for m in messages],
        "tools": [dict(t) for t in tools] if tools is not None else None,
        "add_generation_prompt": add_generation_prompt,
        "bos_token": bos_token or "",
        "eos_token": eos_token or "",
    }
    try:
        return compiled.render(**variables)
    except TemplateRaisedError as exc:
        raise GenerationError(f"chat template rejected the conversation: {exc}") from None
    except jinja2.TemplateError as exc:
        raise GenerationError(f"chat template failed to render: {type(exc).__name__}: {exc}") from None
    except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
        raise GenerationError(f"chat template failed to render: {type(exc).__name__}: {exc}") from None
