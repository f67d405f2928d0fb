"""`POST /v1/messages` and `POST /v1/messages/count_tokens` (Anthropic Messages API), plain and streamed.

`system` is a string or text blocks; messages hold text / tool_use / tool_result / thinking blocks. Output
is thinking, text and tool_use blocks with `stop_reason` end_turn / tool_use / max_tokens / stop_sequence.
The stream follows the official event order: message_start, ping, then per block content_block_start,
content_block_delta (text_delta / thinking_delta / input_json_delta), content_block_stop, and finally
message_delta (stop_reason, usage) and message_stop. Errors use Anthropic's error format.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from dflash.server.body import read_json_object, validate
from dflash.server.cache_control import prefix_cache_wanted
from dflash.server.context import ServerContext, context_of, sampling_params
from dflash.server.conversation import Message, ToolCall, ToolChoice, ToolSpec, new_id
from dflash.server.engine_port import cached_prompt_tokens
from dflash.server.errors import APIError, anthropic_error_body
from dflash.server.runner import TurnHandle, error_for
from dflash.server.schemas_anthropic import (
    AnthropicMessage,
    CountTokensRequest,
    MessagesRequest,
    MidConversationSystemBlock,
    TextBlock,
    ThinkingBlock,
    ToolResultBlock,
    ToolUseBlock,
)
from dflash.server.sse import EventStreamResponse, named_event
from dflash.server.turn import DoneEvent, ErrorEvent, Outcome, TextEvent, ToolCallEvent

router = APIRouter()


# ------------------------------------------------------------------------------------------- request
def _unsupported(block_type: str, where: str) -> APIError:
    return APIError(400, f"{where}: {block_type} blocks are not supported by this server (text only)", param=where)


def _result_text(block: ToolResultBlock, where: str) -> str:
    if block.content is None:
        text = ""
    elif isinstance(block.content, str):
        text = block.content
    else:
        parts = []
        for k, part in enumerate(block.content):
            if not isinstance(part, TextBlock):
                raise _unsupported(part.type, f"{where}.content.{k}")
            parts.append(part.text)
        text = "\n".join(parts)
    return f"Error: {text}" if block.is_error else text


def _system_text(content: str | list[Any], where: str) -> str:
    if isinstance(content, str):
        return content
    texts = []
    for j, block in enumerate(content):
        if not isinstance(block, TextBlock):
            # "role system ... not supported": the words Claude Code's fallback (resend without such messages) reads
            raise APIError(400, f"{where}.content.{j}: {block.type} blocks in a message with role system are not "
                           "supported (text blocks only)", param=f"{where}.content.{j}")
        texts.append(block.text)
    return "\n\n".join(texts)


def _add_system(out: list[Message], leading: list[str], text: str) -> None:
    """System text at the current end of the conversation: before any turn it joins the top-level `system`, after
    another system message it joins that one."""
    if not text:
        return
    if not out:
        leading.append(text)
    elif out[-1].role == "system":
        out[-1].content = f"{out[-1].content}\n\n{text}"
    else:
        out.append(Message("system", text))


def convert_messages(system: str | list[TextBlock] | None, messages: list[AnthropicMessage]) -> list[Message]:
    """Anthropic conversation -> API-neutral messages.

    Mid-conversation system instructions (`role: "system"` entries of `messages`, which Claude Code sends on every
    request, and `mid_conv_system` blocks that end a turn) are kept where they stand, so the prompt builder renders
    them at that point; ones before the first turn join the top-level `system`, and consecutive ones are joined.
    """
    out: list[Message] = []
    leading: list[str] = []
    if system:
        text = system if isinstance(system, str) else "\n\n".join(b.text for b in system)
        if text:
            leading.append(text)
    for i, m in enumerate(messages):
        if m.role == "system":
            _add_system(out, leading, _system_text(m.content, f"messages.{i}"))
            continue
        if isinstance(m.content, str):
            out.append(Message(m.role, m.content))
            continue
        texts: list[str] = []
        thinking: list[str] = []
        calls: list[ToolCall] = []
        instructions: list[str] = []  # mid_conv_system blocks: after the turn's own content
        for j, block in enumerate(m.content):
            where = f"messages.{i}.content.{j}"
            if isinstance(block, TextBlock):
                texts.append(block.text)
            elif isinstance(block, ThinkingBlock):
                thinking.append(block.thinking)
            elif isinstance(block, ToolUseBlock):
                if m.role != "assistant":
                    raise APIError(400, f"{where}: tool_use blocks belong in assistant messages", param=where)
                calls.append(ToolCall(name=block.name, arguments=dict(block.input), id=block.id))
            elif isinstance(block, ToolResultBlock):
                if m.role != "user":
                    raise APIError(400, f"{where}: tool_result blocks belong in user messages", param=where)
                out.append(Message("tool", _result_text(block, where), tool_call_id=block.tool_use_id))
            elif isinstance(block, MidConversationSystemBlock):
                instructions.append(_system_text(block.content, where))
            elif block.type == "redacted_thinking":
                continue
            else:
                raise _unsupported(block.type, where)
        if texts or calls or thinking:
            out.append(Message(m.role, "".join(texts), reasoning="".join(thinking) or None, tool_calls=calls))
        for text in instructions:
            _add_system(out, leading, text)
    if leading:
        out.insert(0, Message("system", "\n\n".join(leading)))
    return out


def convert_tools(body: CountTokensRequest | MessagesRequest) -> tuple[list[ToolSpec], ToolChoice]:
    tools = []
    for i, t in enumerate(body.tools or []):
        if t.input_schema is None:
            raise APIError(400, f"tools.{i}: tool {t.name!r} has no input_schema (server tools are not supported)",
                           param=f"tools.{i}.input_schema")
        tools.append(ToolSpec(t.name, t.description or "", t.input_schema, strict=bool(t.strict)))
    choice = body.tool_choice
    if choice is None or choice.type == "auto":
        return tools, ToolChoice("auto")
    if choice.type == "none":
        return tools, ToolChoice("none")
    if choice.type == "any":
        return tools, ToolChoice("required")
    if not choice.name:
        raise APIError(400, "tool_choice.name: a tool choice of type 'tool' needs the tool's name", param="tool_choice.name")
    return tools, ToolChoice("named", choice.name)


def template_kwargs(body: CountTokensRequest | MessagesRequest) -> dict[str, Any]:
    kwargs = dict(body.chat_template_kwargs or {})
    if body.thinking is not None and "enable_thinking" not in kwargs:
        kwargs["enable_thinking"] = body.thinking.type != "disabled"
    return kwargs


# ------------------------------------------------------------------------------------------ response
def stop_reason(outcome: Outcome) -> str:
    if outcome.finish_reason == "tool_calls":
        return "tool_use"
    if outcome.finish_reason == "length":
        return "max_tokens"
    return "stop_sequence" if outcome.stop_sequence else "end_turn"


def usage_of(outcome: Outcome) -> dict[str, Any]:
    """Anthropic counts cached prompt tokens apart: input_tokens + cache_read_input_tokens = the whole prompt."""
    return {
        "input_tokens": outcome.prompt_tokens - outcome.cached_tokens, "output_tokens": outcome.completion_tokens,
        "cache_creation_input_tokens": 0, "cache_read_input_tokens": outcome.cached_tokens,
    }


def message_body(mid: str, model: str, outcome: Outcome) -> dict[str, Any]:
    content: list[dict[str, Any]] = []
    if outcome.reasoning:
        content.append({"type": "thinking", "thinking": outcome.reasoning, "signature": ""})
    if outcome.content:
        content.append({"type": "text", "text": outcome.content})
    content.extend(
        {"type": "tool_use", "id": _tool_use_id(c), "name": c.name, "input": c.arguments if c.arguments is not None else {}}
        for c in outcome.tool_calls
    )
    return {
        "id": mid, "type": "message", "role": "assistant", "model": model, "content": content,
        "stop_reason": stop_reason(outcome), "stop_sequence": outcome.stop_sequence, "usage": usage_of(outcome),
        "timings": outcome.timings(),
    }


def _tool_use_id(call: ToolCall) -> str:
    return call.id if call.id.startswith("toolu_") else "toolu_" + call.id.removeprefix("call_")


class _Blocks:
    """Tracks the open content block of a stream and emits start/stop events around deltas."""

    def __init__(self) -> None:
        self.index = -1
        self.open_kind: str | None = None

    def close(self) -> list[str]:
        if self.open_kind is None:
            return []
        self.open_kind = None
        return [named_event("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def open(self, kind: str, block: dict[str, Any]) -> list[str]:
        events = self.close()
        self.index += 1
        self.open_kind = kind
        events.append(named_event("content_block_start", {"type": "content_block_start", "index": self.index,
                                                          "content_block": block}))
        return events

    def delta(self, delta: dict[str, Any]) -> str:
        return named_event("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})


async def stream_message(
    handle: TurnHandle, mid: str, model: str, prompt_tokens: int, cached_tokens: int
) -> AsyncGenerator[str, None]:
    """The event stream of one message. `cached_tokens`: the prefix cache's forecast for the prompt, split off in
    message_start as Anthropic does; message_delta carries the figure the generation actually restored."""
    start: dict[str, Any] = {
        "id": mid, "type": "message", "role": "assistant", "model": model, "content": [], "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": prompt_tokens - cached_tokens, "output_tokens": 0, "cache_creation_input_tokens": 0,
                  "cache_read_input_tokens": cached_tokens},
    }
    yield named_event("message_start", {"type": "message_start", "message": start})
    yield named_event("ping", {"type": "ping"})
    blocks = _Blocks()
    async for event in handle.events():
        if event is None:
            yield named_event("ping", {"type": "ping"})
        elif isinstance(event, TextEvent):
            if event.channel == "reasoning":
                if blocks.open_kind != "thinking":
                    for e in blocks.open("thinking", {"type": "thinking", "thinking": "", "signature": ""}):
                        yield e
                yield blocks.delta({"type": "thinking_delta", "thinking": event.text})
            else:
                if blocks.open_kind != "text":
                    for e in blocks.open("text", {"type": "text", "text": ""}):
                        yield e
                yield blocks.delta({"type": "text_delta", "text": event.text})
        elif isinstance(event, ToolCallEvent):
            call = event.call
            for e in blocks.open("tool_use", {"type": "tool_use", "id": _tool_use_id(call), "name": call.name, "input": {}}):
                yield e
            yield blocks.delta({"type": "input_json_delta", "partial_json": call.arguments_json if call.arguments is not None else "{}"})
            for e in blocks.close():
                yield e
        elif isinstance(event, ErrorEvent):
            for e in blocks.close():
                yield e
            yield named_event("error", anthropic_error_body(error_for(event.error)))
            return
        elif isinstance(event, DoneEvent):
            outcome = event.outcome
            if outcome.finish_reason == "cancelled":
                return
            for e in blocks.close():
                yield e
            yield named_event("message_delta", {
                "type": "message_delta",
                "delta": {"stop_reason": stop_reason(outcome), "stop_sequence": outcome.stop_sequence},
                "usage": usage_of(outcome),  # cumulative: the cached share is known only now
                "timings": outcome.timings(),
            })
            yield named_event("message_stop", {"type": "message_stop"})


# ------------------------------------------------------------------------------------------- routes
@router.post("/v1/messages")
async def messages(request: Request) -> Response:
    received_at = time.perf_counter()
    ctx: ServerContext = context_of(request)
    body = validate(MessagesRequest, await read_json_object(request, ctx.settings.max_body_bytes))
    model = ctx.resolve_model(body.model)
    conversation = convert_messages(body.system, body.messages)
    tools, choice = convert_tools(body)
    prompt = await ctx.build_prompt(conversation, tools, choice, template_kwargs(body))
    stops = body.stop_sequences or []
    if any(not s for s in stops):
        raise APIError(400, "stop_sequences entries must be non-empty strings", param="stop_sequences")
    turn = await ctx.chat_turn(
        prompt,
        max_new_tokens=ctx.max_new_tokens(body.max_tokens, len(prompt.ids), api="anthropic", param="max_tokens"),
        sampling=sampling_params(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k),
        stop=stops,
        choice=choice,
        received_at=received_at,
        use_prefix_cache=prefix_cache_wanted(request, body.cache_prompt),
    )
    # asked before the turn starts, so its own prefill cannot inflate the figure (the lookup may wait on the cache's lock)
    cached = await run_in_threadpool(cached_prompt_tokens, ctx.engine, turn.request) if body.stream else 0
    handle = ctx.runner.start(turn, "messages")
    mid = new_id("msg_")
    if body.stream:
        stream = stream_message(handle, mid, model, len(prompt.ids), cached)
        return EventStreamResponse(stream, on_close=handle.cancel)
    outcome = await handle.outcome_unless_disconnected(request)
    if outcome.finish_reason == "cancelled":
        return JSONResponse(anthropic_error_body(APIError(499, "client closed the request")), status_code=499)
    return JSONResponse(message_body(mid, model, outcome))


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request) -> Response:
    ctx = context_of(request)
    body = validate(CountTokensRequest, await read_json_object(request, ctx.settings.max_body_bytes))
    ctx.resolve_model(body.model)
    tools, choice = convert_tools(body)
    prompt = await ctx.build_prompt(convert_messages(body.system, body.messages), tools, choice, template_kwargs(body))
    return JSONResponse({"input_tokens": len(prompt.ids)})
