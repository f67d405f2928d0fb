"""`POST /v1/responses` (OpenAI Responses API, the one Codex speaks), plain and streamed.

`input` is a string or a list of message / function_call / function_call_output / reasoning items;
`instructions` becomes the system message; function tools only. The server keeps no state
(`previous_response_id` is refused), so clients send the whole conversation, as Codex does.
Streams emit response.created, response.in_progress, then per output item response.output_item.added,
content_part.added, output_text.delta / reasoning_text.delta / function_call_arguments.delta, the matching
.done events and response.output_item.done, and end with response.completed (or response.incomplete when
`max_output_tokens` cut the answer short, response.failed on an error).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from dflash.server.body import read_json_object, validate
from dflash.server.cache_control import prefix_cache_wanted
from dflash.server.context import ServerContext, context_of, sampling_params
from dflash.server.conversation import Message, ToolCall, ToolChoice, ToolSpec, new_id, parse_arguments
from dflash.server.errors import APIError, openai_error_body
from dflash.server.response_format import responses_answer_schema
from dflash.server.runner import TurnHandle, error_for
from dflash.server.schemas_responses import (
    FunctionCallItem,
    FunctionCallOutputItem,
    InputContent,
    MessageItem,
    ReasoningItem,
    ResponsesRequest,
)
from dflash.server.sse import EventStreamResponse, named_event
from dflash.server.turn import DoneEvent, ErrorEvent, Outcome, TextEvent, ToolCallEvent

log = logging.getLogger("dflash.server")
router = APIRouter()

_TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")


# ------------------------------------------------------------------------------------------- request
def _text(content: str | list[InputContent], where: str) -> str:
    if isinstance(content, str):
        return content
    texts = []
    for k, part in enumerate(content):
        if part.type not in _TEXT_PARTS or part.text is None:
            raise APIError(400, f"{where}.{k}: content of type {part.type!r} is not supported (text only)",
                           param=f"{where}.{k}.type")
        texts.append(part.text)
    return "".join(texts)


def convert_input(body: ResponsesRequest) -> list[Message]:
    out: list[Message] = []
    if body.instructions:
        out.append(Message("system", body.instructions))
    if isinstance(body.input, str):
        out.append(Message("user", body.input))
        return out
    reasoning: str | None = None
    for i, raw in enumerate(body.input):
        where = f"input.{i}"
        kind = raw.get("type", "message" if "role" in raw else None)
        if kind == "message":
            item = validate(MessageItem, raw, where=where)
            out.append(Message(item.role, _text(item.content, f"{where}.content"),
                               reasoning=reasoning if item.role == "assistant" else None))
            reasoning = None
        elif kind == "function_call":
            call_item = validate(FunctionCallItem, raw, where=where)
            arguments = parse_arguments(call_item.arguments)
            if arguments is None:
                raise APIError(400, f"{where}.arguments must be a JSON object encoded as a string",
                               param=f"{where}.arguments")
            call = ToolCall(name=call_item.name, arguments=arguments, id=call_item.call_id)
            if out and out[-1].role == "assistant":
                out[-1].tool_calls.append(call)
            else:
                out.append(Message("assistant", "", reasoning=reasoning, tool_calls=[call]))
                reasoning = None
        elif kind == "function_call_output":
            result = validate(FunctionCallOutputItem, raw, where=where)
            out.append(Message("tool", _text(result.output, f"{where}.output"), tool_call_id=result.call_id))
        elif kind == "reasoning":
            thought = validate(ReasoningItem, raw, where=where)
            parts = thought.content or thought.summary
            reasoning = "".join(p.text or "" for p in parts) or None
        else:
            raise APIError(
                400, f"{where}.type: input items of type {kind!r} are not supported "
                "(message, function_call, function_call_output, reasoning)", param=f"{where}.type",
            )
    return out


def convert_tools(body: ResponsesRequest) -> tuple[list[ToolSpec], ToolChoice]:
    tools = []
    for i, tool in enumerate(body.tools or []):
        if tool.type != "function":
            log.warning("ignoring a %r tool: only function tools are supported", tool.type)
            continue
        if not tool.name:
            raise APIError(400, f"tools.{i}.name: a function tool needs a name", param=f"tools.{i}.name")
        tools.append(ToolSpec(
            tool.name, tool.description or "", tool.parameters or {"type": "object", "properties": {}},
            strict=bool(tool.strict),
        ))
    choice = body.tool_choice
    if choice is None or choice == "auto":
        return tools, ToolChoice("auto")
    if choice in ("none", "required"):
        return tools, ToolChoice("none" if choice == "none" else "required")
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return tools, ToolChoice("named", choice["name"])
    raise APIError(400, f"tool_choice {choice!r} is not supported: use 'auto', 'none', 'required' or "
                   "{'type': 'function', 'name': ...}", param="tool_choice")


# ------------------------------------------------------------------------------------------ response
def usage_of(outcome: Outcome) -> dict[str, Any]:
    return {
        "input_tokens": outcome.prompt_tokens,
        "input_tokens_details": {"cached_tokens": outcome.cached_tokens},
        "output_tokens": outcome.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": outcome.prompt_tokens + outcome.completion_tokens,
    }


class ResponseShell:
    """The fields of a response object that do not depend on the output."""

    def __init__(self, rid: str, model: str, body: ResponsesRequest) -> None:
        self.rid, self.model, self.body = rid, model, body
        self.created_at = int(time.time())

    def render(self, status: str, output: list[dict[str, Any]], outcome: Outcome | None = None,
               error: dict[str, Any] | None = None) -> dict[str, Any]:
        body = self.body
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {
            "id": self.rid, "object": "response", "created_at": self.created_at, "status": status,
            "model": self.model, "output": output, "error": error, "incomplete_details": incomplete,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "parallel_tool_calls": body.parallel_tool_calls if body.parallel_tool_calls is not None else True,
            "tool_choice": body.tool_choice if body.tool_choice is not None else "auto",
            "tools": [t.model_dump(exclude_none=True) for t in body.tools or [] if t.type == "function"],
            "temperature": body.temperature, "top_p": body.top_p, "metadata": {},
            "text": {"format": _format_of(body)},
            "usage": usage_of(outcome) if outcome is not None else None,
            **({"timings": outcome.timings()} if outcome is not None else {}),
        }


def _format_of(body: ResponsesRequest) -> Any:
    """The answer format the request asked for (`text.format`), echoed in the response object."""
    text = (body.model_extra or {}).get("text")
    fmt = text.get("format") if isinstance(text, dict) else None
    return fmt if isinstance(fmt, dict) else {"type": "text"}


class OutputItems:
    """Builds output items from turn events; returns the stream events (type, payload) each step makes."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self.current: dict[str, Any] | None = None
        self.text = ""

    def _index(self) -> int:
        return len(self.items) - 1

    def close(self) -> list[tuple[str, dict[str, Any]]]:
        item, self.current = self.current, None
        if item is None:
            return []
        index, events = self.items.index(item), []
        if item["type"] == "message":
            part = {"type": "output_text", "text": self.text, "annotations": [], "logprobs": []}
            item["content"] = [part]
            events += [
                ("response.output_text.done", {"item_id": item["id"], "output_index": index, "content_index": 0,
                                               "text": self.text, "logprobs": []}),
                ("response.content_part.done", {"item_id": item["id"], "output_index": index, "content_index": 0,
                                                "part": part}),
            ]
        else:
            part = {"type": "reasoning_text", "text": self.text}
            item["content"] = [part]
            events += [
                ("response.reasoning_text.done", {"item_id": item["id"], "output_index": index, "content_index": 0,
                                                  "text": self.text}),
                ("response.content_part.done", {"item_id": item["id"], "output_index": index, "content_index": 0,
                                                "part": part}),
            ]
        item["status"] = "completed"
        events.append(("response.output_item.done", {"output_index": index, "item": item}))
        self.text = ""
        return events

    def add_text(self, channel: str, text: str) -> list[tuple[str, dict[str, Any]]]:
        kind = "message" if channel == "content" else "reasoning"
        events: list[tuple[str, dict[str, Any]]] = []
        if self.current is None or self.current["type"] != kind:
            events += self.close()
            if kind == "message":
                item: dict[str, Any] = {"id": new_id("msg_"), "type": "message", "status": "in_progress",
                                        "role": "assistant", "content": []}
                part: dict[str, Any] = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            else:
                item = {"id": new_id("rs_"), "type": "reasoning", "status": "in_progress", "summary": [], "content": []}
                part = {"type": "reasoning_text", "text": ""}
            self.items.append(item)
            self.current = item
            events += [
                ("response.output_item.added", {"output_index": self._index(), "item": dict(item)}),
                ("response.content_part.added", {"item_id": item["id"], "output_index": self._index(),
                                                 "content_index": 0, "part": part}),
            ]
        assert self.current is not None
        self.text += text
        delta_type = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        payload: dict[str, Any] = {"item_id": self.current["id"], "output_index": self.items.index(self.current),
                                   "content_index": 0, "delta": text}
        if kind == "message":
            payload["logprobs"] = []
        events.append((delta_type, payload))
        return events

    def add_call(self, call: ToolCall) -> list[tuple[str, dict[str, Any]]]:
        events = self.close()
        item = {"id": new_id("fc_"), "type": "function_call", "status": "in_progress", "call_id": call.id,
                "name": call.name, "arguments": ""}
        self.items.append(item)
        index, arguments = self._index(), call.arguments_json
        events.append(("response.output_item.added", {"output_index": index, "item": dict(item)}))
        events.append(("response.function_call_arguments.delta", {"item_id": item["id"], "output_index": index,
                                                                   "delta": arguments}))
        events.append(("response.function_call_arguments.done", {"item_id": item["id"], "output_index": index,
                                                                  "arguments": arguments, "name": call.name}))
        item.update(arguments=arguments, status="completed")
        events.append(("response.output_item.done", {"output_index": index, "item": item}))
        return events


def status_of(outcome: Outcome) -> str:
    return "incomplete" if outcome.finish_reason == "length" else "completed"


def output_of(outcome: Outcome) -> list[dict[str, Any]]:
    items = OutputItems()
    if outcome.reasoning:
        items.add_text("reasoning", outcome.reasoning)
    if outcome.content:
        items.add_text("content", outcome.content)
    for call in outcome.tool_calls:
        items.add_call(call)
    items.close()
    return items.items


async def stream_response(handle: TurnHandle, shell: ResponseShell) -> AsyncGenerator[str, None]:
    sequence = 0

    def event(kind: str, payload: dict[str, Any]) -> str:
        nonlocal sequence
        sequence += 1
        return named_event(kind, {"type": kind, "sequence_number": sequence - 1, **payload})

    yield event("response.created", {"response": shell.render("in_progress", [])})
    yield event("response.in_progress", {"response": shell.render("in_progress", [])})
    items = OutputItems()
    async for turn_event in handle.events():
        steps: list[tuple[str, dict[str, Any]]] = []
        if turn_event is None:
            yield ": keep-alive\n\n"
            continue
        if isinstance(turn_event, TextEvent):
            steps = items.add_text(turn_event.channel, turn_event.text)
        elif isinstance(turn_event, ToolCallEvent):
            steps = items.add_call(turn_event.call)
        elif isinstance(turn_event, ErrorEvent):
            err = error_for(turn_event.error)
            failure = {"code": "server_error" if err.status >= 500 else "invalid_prompt", "message": err.message}
            for kind, payload in items.close():
                yield event(kind, payload)
            yield event("response.failed", {"response": shell.render("failed", items.items, error=failure)})
            return
        elif isinstance(turn_event, DoneEvent):
            outcome = turn_event.outcome
            if outcome.finish_reason == "cancelled":
                return
            for kind, payload in items.close():
                yield event(kind, payload)
            status = status_of(outcome)
            final = "response.incomplete" if status == "incomplete" else "response.completed"
            yield event(final, {"response": shell.render(status, items.items, outcome)})
            return
        for kind, payload in steps:
            yield event(kind, payload)


# -------------------------------------------------------------------------------------------- route
@router.post("/v1/responses")
async def responses(request: Request) -> Response:
    received_at = time.perf_counter()
    ctx: ServerContext = context_of(request)
    body = validate(ResponsesRequest, await read_json_object(request, ctx.settings.max_body_bytes))
    model = ctx.resolve_model(body.model)
    if body.previous_response_id:
        raise APIError(400, "previous_response_id is not supported: this server stores no responses; send the "
                       "whole conversation in input", param="previous_response_id", code="unsupported_parameter")
    conversation = convert_input(body)
    if not conversation:
        raise APIError(400, "input is empty", param="input")
    tools, choice = convert_tools(body)
    answer = responses_answer_schema((body.model_extra or {}).get("text"))
    prompt = await ctx.build_prompt(conversation, tools, choice, body.chat_template_kwargs)
    turn = await ctx.chat_turn(
        prompt,
        max_new_tokens=ctx.max_new_tokens(body.max_output_tokens, len(prompt.ids), api="responses", param="max_output_tokens"),
        sampling=sampling_params(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, seed=body.seed),
        stop=[],
        choice=choice,
        received_at=received_at,
        use_prefix_cache=prefix_cache_wanted(request, body.cache_prompt),
        answer=answer,
    )
    handle = ctx.runner.start(turn, "responses")
    shell = ResponseShell(new_id("resp_"), model, body)
    if body.stream:
        return EventStreamResponse(stream_response(handle, shell), on_close=handle.cancel)
    outcome = await handle.outcome_unless_disconnected(request)
    if outcome.finish_reason == "cancelled":
        return JSONResponse(openai_error_body(APIError(499, "client closed the request")), status_code=499)
    return JSONResponse(shell.render(status_of(outcome), output_of(outcome), outcome))
