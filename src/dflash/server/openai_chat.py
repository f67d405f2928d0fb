"""`POST /v1/chat/completions` (OpenAI chat completions), plain and streamed.

Messages may be system / developer / user / assistant / tool with string or text-part content; tool calls
come back as `tool_calls` with finish reason "tool_calls", reasoning as `reasoning_content`. Responses carry
`usage` and a `timings` object (prefill / decode time, draft and accepted tokens, acceptance length).
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from dflash.server.body import read_json_object, validate
from dflash.server.cache_control import prefix_cache_wanted
from dflash.server.context import ServerContext, context_of, now, sampling_params, stop_list
from dflash.server.conversation import Message, ToolCall, ToolChoice, ToolSpec, new_id, parse_arguments
from dflash.server.errors import APIError, openai_error_body
from dflash.server.response_format import chat_answer_schema
from dflash.server.runner import TurnHandle, error_for
from dflash.server.schemas_openai import ChatCompletionRequest, ChatMessage, ContentPart
from dflash.server.sse import DONE, KEEPALIVE, EventStreamResponse, data_event
from dflash.server.turn import DoneEvent, ErrorEvent, Outcome, TextEvent, ToolCallEvent

router = APIRouter()


# ------------------------------------------------------------------------------------------- request
def text_of(content: str | list[ContentPart] | None, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for i, part in enumerate(content):
        if part.type in ("text", "input_text", "output_text") and part.text is not None:
            texts.append(part.text)
        elif part.type in ("text", "input_text", "output_text"):
            raise APIError(400, f"{where}.{i}: a text part needs a 'text' string", param=f"{where}.{i}.text")
        else:
            raise APIError(
                400, f"{where}.{i}: content parts of type {part.type!r} are not supported (text only)",
                param=f"{where}.{i}.type",
            )
    return "".join(texts)


def convert_messages(messages: list[ChatMessage]) -> list[Message]:
    out: list[Message] = []
    for i, m in enumerate(messages):
        where = f"messages.{i}.content"
        if m.role in ("system", "developer", "user") and m.content is None:
            raise APIError(400, f"{where}: a {m.role} message needs content", param=where)
        calls = []
        for j, call in enumerate(m.tool_calls or []):
            raw = call.function.arguments
            arguments = raw if isinstance(raw, dict) else parse_arguments(raw)
            if arguments is None:
                raise APIError(
                    400, f"messages.{i}.tool_calls.{j}.function.arguments must be a JSON object encoded as a string",
                    param=f"messages.{i}.tool_calls.{j}.function.arguments",
                )
            calls.append(ToolCall(name=call.function.name, arguments=arguments, id=call.id or new_id("call_")))
        if m.role == "tool" and not m.tool_call_id:
            raise APIError(400, f"messages.{i}.tool_call_id: a tool message needs the id of the call it answers",
                           param=f"messages.{i}.tool_call_id")
        out.append(Message(
            role=m.role, content=text_of(m.content, where), reasoning=m.reasoning_content, tool_calls=calls,
            tool_call_id=m.tool_call_id, name=m.name,
        ))
    return out


def convert_tools(body: ChatCompletionRequest) -> tuple[list[ToolSpec], ToolChoice]:
    tools = [
        ToolSpec(
            t.function.name, t.function.description or "",
            t.function.parameters or {"type": "object", "properties": {}}, strict=bool(t.function.strict),
        )
        for t in body.tools or []
    ]
    choice = body.tool_choice
    if choice is None or choice == "auto":
        return tools, ToolChoice("auto")
    if choice == "none":
        return tools, ToolChoice("none")
    if choice == "required":
        return tools, ToolChoice("required")
    assert not isinstance(choice, str)
    return tools, ToolChoice("named", choice.function.name)


def check_unsupported(body: ChatCompletionRequest) -> None:
    if body.n is not None and body.n > 1:
        raise APIError(400, f"n={body.n} is not supported: this server returns one choice per request (use n=1)",
                       param="n", code="unsupported_parameter")
    if body.logprobs:
        raise APIError(400, "logprobs are not supported by this server", param="logprobs", code="unsupported_parameter")


# ------------------------------------------------------------------------------------------ response
def usage_of(outcome: Outcome) -> dict[str, Any]:
    return {
        "prompt_tokens": outcome.prompt_tokens,
        "completion_tokens": outcome.completion_tokens,
        "total_tokens": outcome.prompt_tokens + outcome.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": outcome.cached_tokens},
    }


def tool_call_json(call: ToolCall, index: int | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments_json}}
    if index is not None:
        out = {"index": index, **out}
    return out


def completion_body(cid: str, model: str, created: int, outcome: Outcome) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": outcome.content or (None if outcome.tool_calls else "")}
    if outcome.reasoning:
        message["reasoning_content"] = outcome.reasoning
    if outcome.tool_calls:
        message["tool_calls"] = [tool_call_json(c) for c in outcome.tool_calls]
    return {
        "id": cid, "object": "chat.completion", "created": created, "model": model, "system_fingerprint": None,
        "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": outcome.finish_reason}],
        "usage": usage_of(outcome),
        "timings": outcome.timings(),
    }


def _chunk(cid: str, model: str, created: int, delta: dict[str, Any], finish: str | None = None,
           usage_null: bool = False) -> dict[str, Any]:
    chunk: dict[str, Any] = {
        "id": cid, "object": "chat.completion.chunk", "created": created, "model": model, "system_fingerprint": None,
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
    }
    if usage_null:
        chunk["usage"] = None
    return chunk


async def stream_chat(handle: TurnHandle, cid: str, model: str, created: int, include_usage: bool) -> AsyncGenerator[str, None]:
    yield data_event(_chunk(cid, model, created, {"role": "assistant", "content": ""}, usage_null=include_usage))
    calls = 0
    async for event in handle.events():
        if event is None:
            yield KEEPALIVE
        elif isinstance(event, TextEvent):
            key = "content" if event.channel == "content" else "reasoning_content"
            yield data_event(_chunk(cid, model, created, {key: event.text}, usage_null=include_usage))
        elif isinstance(event, ToolCallEvent):
            delta = {"tool_calls": [tool_call_json(event.call, calls)]}
            calls += 1
            yield data_event(_chunk(cid, model, created, delta, usage_null=include_usage))
        elif isinstance(event, ErrorEvent):
            yield data_event(openai_error_body(error_for(event.error)))
            return
        elif isinstance(event, DoneEvent):
            outcome = event.outcome
            if outcome.finish_reason == "cancelled":
                return
            final = _chunk(cid, model, created, {}, outcome.finish_reason, usage_null=include_usage)
            final["timings"] = outcome.timings()
            yield data_event(final)
            if include_usage:
                yield data_event({
                    "id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                    "system_fingerprint": None, "choices": [], "usage": usage_of(outcome), "timings": outcome.timings(),
                })
            yield DONE


# ------------------------------------------------------------------------------------------- route
@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    received_at = time.perf_counter()
    ctx: ServerContext = context_of(request)
    body = validate(ChatCompletionRequest, await read_json_object(request, ctx.settings.max_body_bytes))
    model = ctx.resolve_model(body.model)
    check_unsupported(body)
    answer = chat_answer_schema(body.response_format.model_dump() if body.response_format is not None else None)
    messages = convert_messages(body.messages)
    tools, choice = convert_tools(body)
    prompt = await ctx.build_prompt(messages, tools, choice, body.chat_template_kwargs)
    requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    turn = await ctx.chat_turn(
        prompt,
        max_new_tokens=ctx.max_new_tokens(requested, len(prompt.ids), api="chat", param=param),
        sampling=sampling_params(
            temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, min_p=body.min_p, seed=body.seed,
            presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
        ),
        stop=stop_list(body.stop),
        choice=choice,
        received_at=received_at,
        use_prefix_cache=prefix_cache_wanted(request, body.cache_prompt),
        answer=answer,
    )
    handle = ctx.runner.start(turn, "chat")
    cid, created = new_id("chatcmpl-"), now()
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return EventStreamResponse(stream_chat(handle, cid, model, created, include_usage), on_close=handle.cancel)
    outcome = await handle.outcome_unless_disconnected(request)
    if outcome.finish_reason == "cancelled":
        return JSONResponse(openai_error_body(APIError(499, "client closed the request")), status_code=499)
    return JSONResponse(completion_body(cid, model, created, outcome))
