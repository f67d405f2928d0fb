"""Conversation -> prompt token ids through the chat template (the tokenizer's, or `--chat-template-file`).

Templates that render `tools` get them natively (Hermes / Qwen JSON calls, or Qwen3-Coder XML calls when
the template speaks `<function=...>`). Templates without tool support (the default SmolLM2 ChatML one) get
a system-prompt section that describes the tools and asks for `<tool_call>{"name", "arguments"}</tool_call>`;
earlier calls and results are written into the conversation as text in that same format.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dflash.chat_template import render_chat_template
from dflash.errors import GenerationError
from dflash.server.conversation import Message, ToolChoice, ToolSpec
from dflash.server.engine_port import EnginePort
from dflash.server.errors import APIError
from dflash.server.reasoning import THINK_OPEN
from dflash.server.tool_calls import ToolFormat, forced_opening, format_call_text
from dflash.special_text import SpecialTextGuard

_RESERVED_KWARGS = frozenset({"template", "messages", "tools", "add_generation_prompt", "bos_token", "eos_token"})
AUTO = ToolChoice("auto")
_PROBE_TOOL = ToolSpec("dflash_probe_tool_7f3a", "probe", {"type": "object", "properties": {}})


@dataclass(frozen=True)
class Prompt:
    text: str  # rendered template, before the forced prefix
    ids: list[int]  # of text + forced_prefix
    forced_prefix: str
    starts_in_reasoning: bool
    tools: tuple[ToolSpec, ...]  # tools the model was offered (empty with tool_choice "none")
    tool_format: ToolFormat


class PromptBuilder:
    def __init__(self, engine: EnginePort, template: str | None = None, *, remap_developer_role: bool = False) -> None:
        self.engine = engine
        self.template = template or engine.tokenizer.chat_template
        self.remap_developer_role = remap_developer_role
        self.native_tools = self._renders_tools()
        self._guard()  # the tokenizer's special-token tables are built now, not during the first request
        self.tool_format: ToolFormat = (
            "xml" if self.template and "<function=" in self.template and "<parameter=" in self.template else "json"
        )

    def _renders_tools(self) -> bool:
        if not self.template:
            return False
        try:
            text = self._render([{"role": "user", "content": "hi"}], [_PROBE_TOOL.template_dict()], {})
        except GenerationError:
            return False
        return _PROBE_TOOL.name in text

    def _render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, kwargs: Mapping[str, Any]) -> str:
        if not self.template:
            raise APIError(
                400, "this model has no chat template: use /v1/completions, or start the server with "
                "--chat-template-file", code="no_chat_template",
            )
        tokenizer = self.engine.tokenizer
        return render_chat_template(
            self.template, messages, tools=tools, add_generation_prompt=True,
            bos_token=tokenizer.bos_token, eos_token=tokenizer.eos_token, **kwargs,
        )

    def build(
        self,
        messages: Sequence[Message],
        tools: Sequence[ToolSpec] = (),
        choice: ToolChoice = AUTO,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> Prompt:
        """Raises `APIError` (400) for a conversation the template cannot render as asked."""
        kwargs = dict(template_kwargs or {})
        reserved = sorted(_RESERVED_KWARGS & kwargs.keys())
        if reserved:
            raise APIError(400, f"chat_template_kwargs may not set {', '.join(reserved)}", param="chat_template_kwargs")
        if not messages:
            raise APIError(400, "the conversation has no messages", param="messages")
        names = [t.name for t in tools]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise APIError(400, f"tool names must be unique; repeated: {', '.join(duplicates)}", param="tools")
        if choice.mode in ("required", "named") and not tools:
            raise APIError(400, f"tool_choice {choice.mode!r} needs at least one tool", param="tool_choice")
        if choice.mode == "named" and choice.name not in names:
            raise APIError(
                400, f"tool_choice names {choice.name!r}, which is not among the tools ({', '.join(names)})",
                param="tool_choice",
            )
        offered = tuple(tools) if choice.mode != "none" else ()
        dicts = [self._message_dict(m) for m in messages]
        if offered and not self.native_tools:
            dicts = _with_tool_section(dicts, offered, choice)
        template_tools = [t.template_dict() for t in offered] if offered and self.native_tools else None
        guard = self._guard()
        if guard is not None:  # content goes into the template with its special-token text disarmed
            dicts = guard.protect(dicts)
            template_tools = guard.protect(template_tools)
        text = self._render_conversation(dicts, template_tools, kwargs)
        forced = forced_opening(choice, self.tool_format) if offered else ""
        if guard is None:
            ids = self.engine.encode(text + forced)
        else:
            ids = self.engine.encode(text + forced, guard)
            text = guard.restore(text)
        starts_in_reasoning = not forced and text.rstrip().endswith(THINK_OPEN)
        return Prompt(text, ids, forced, starts_in_reasoning, offered, self.tool_format)

    def _guard(self) -> SpecialTextGuard | None:
        """The tokenizer's special-text guard; stand-in tokenizers without special tokens have none."""
        make = getattr(self.engine.tokenizer, "special_text_guard", None)
        return make() if callable(make) else None

    def _render_conversation(
        self, dicts: list[dict[str, Any]], tools: list[dict[str, Any]] | None, kwargs: Mapping[str, Any]
    ) -> str:
        """The template's rendering of `dicts`. System messages after the first turn (mid-conversation instructions)
        go in as they are where the template renders them; a template that refuses them or leaves their text out is
        given them folded into the neighbouring user turn instead, at the same point of the conversation."""
        inline = [d for i, d in enumerate(dicts) if i > 0 and d["role"] == "system"]
        try:
            text = self._render(dicts, tools, kwargs)
        except GenerationError as exc:
            if not inline:
                raise APIError(400, str(exc)) from None
            text = None
        if inline and (text is None or not all(str(d["content"]) in text for d in inline)):
            try:
                text = self._render(fold_inline_system(dicts), tools, kwargs)
            except GenerationError as exc:
                raise APIError(400, str(exc)) from None
        assert text is not None
        return text

    def _message_dict(self, message: Message) -> dict[str, Any]:
        role = message.role
        if role == "developer" and self.remap_developer_role:
            role = "system"
        if not self.native_tools:
            if role == "tool":
                return {"role": "user", "content": f"<tool_response>\n{message.content}\n</tool_response>"}
            if role == "assistant" and message.tool_calls:
                calls = "\n".join(format_call_text(c) for c in message.tool_calls)
                content = f"{message.content}\n{calls}" if message.content else calls
                return _with_reasoning({"role": role, "content": content}, message)
        out: dict[str, Any] = {"role": role, "content": message.content}
        if message.tool_calls:
            out["tool_calls"] = [
                {
                    "id": c.id, "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments if c.arguments is not None else c.raw_arguments},
                }
                for c in message.tool_calls
            ]
        if role == "tool":
            if message.tool_call_id:
                out["tool_call_id"] = message.tool_call_id
            if message.name:
                out["name"] = message.name
        return _with_reasoning(out, message)


def _with_reasoning(out: dict[str, Any], message: Message) -> dict[str, Any]:
    if message.reasoning:
        out["reasoning_content"] = message.reasoning
    return out


def fold_inline_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """System messages after the first turn joined to the user turn they follow (or, when none precedes, the one
    they precede; else they become a user turn), for templates that render a system message only first."""
    out: list[dict[str, Any]] = []
    carried: list[str] = []  # system text waiting for the next user turn
    for i, message in enumerate(messages):
        if i > 0 and message["role"] == "system":
            if out and out[-1]["role"] == "user":
                out[-1] = {**out[-1], "content": _joined(str(out[-1]["content"] or ""), str(message["content"]))}
            else:
                carried.append(str(message["content"]))
            continue
        if carried and message["role"] == "user":
            message = {**message, "content": _joined("\n\n".join(carried), str(message["content"] or ""))}
            carried = []
        elif carried:
            out.append({"role": "user", "content": "\n\n".join(carried)})
            carried = []
        out.append(message)
    if carried:
        out.append({"role": "user", "content": "\n\n".join(carried)})
    return out


def _joined(first: str, second: str) -> str:
    return f"{first}\n\n{second}" if first and second else first or second


def tool_section(tools: Sequence[ToolSpec], choice: ToolChoice) -> str:
    lines = "\n".join(json.dumps(t.template_dict(), ensure_ascii=False) for t in tools)
    section = (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>\n{lines}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )
    if choice.mode == "required":
        section += "\n\nYou must call at least one function."
    elif choice.mode == "named":
        section += f"\n\nYou must call the function {choice.name}."
    return section


def _with_tool_section(messages: list[dict[str, Any]], tools: Sequence[ToolSpec], choice: ToolChoice) -> list[dict[str, Any]]:
    section = tool_section(tools, choice)
    if messages and messages[0]["role"] in ("system", "developer"):
        first = dict(messages[0])
        first["content"] = f"{first['content']}\n\n{section}" if first.get("content") else section
        return [first, *messages[1:]]
    return [{"role": "system", "content": section}, *messages]
