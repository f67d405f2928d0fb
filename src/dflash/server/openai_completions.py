"""`POST /v1/completions` (OpenAI legacy text completions): raw prompt in, raw text out, plain or streamed.

The prompt is a string or a list of token ids (or a list holding one of those); no chat template,
reasoning or tool parsing is applied.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from dflash.generation.request import GenerationRequest
from dflash.server.body import read_json_object, validate
from dflash.server.cache_control import prefix_cache_wanted
from dflash.server.context import ServerContext, context_of, now, sampling_params, stop_list
from dflash.server.conversation import new_id
from dflash.server.errors import APIError, openai_error_body
from dflash.server.openai_chat import usage_of
from dflash.server.runner import TurnHandle, error_for
from dflash.server.schemas_openai import CompletionRequest
from dflash.server.sse import DONE, KEEPALIVE, EventStreamResponse, data_event
from dflash.server.turn import DoneEvent, ErrorEvent, TextEvent, Turn

router = APIRouter()


def prompt_ids(ctx: ServerContext, prompt: str | list[str] | list[int] | list[list[int]]) -> tuple[list[int], str]:
    """(token ids, prompt text for `echo`)."""
    if isinstance(prompt, str):
        return ctx.engine.encode(prompt), prompt
    items: list[Any] = list(prompt)
    if items and all(isinstance(p, int) for p in items):
        ids = [int(p) for p in items]
    elif len(items) == 1 and isinstance(items[0], str):
        return ctx.engine.encode(items[0]), items[0]
    elif len(items) == 1 and isinstance(items[0], list):
        ids = [int(p) for p in items[0]]
    elif not items:
        raise APIError(400, "prompt is empty", param="prompt")
    else:
        raise APIError(400, f"batched prompts ({len(items)}) are not supported: send one prompt per request",
                       param="prompt", code="unsupported_parameter")
    if not ids:
        raise APIError(400, "prompt is empty", param="prompt")
    check_token_ids(ids, getattr(ctx.engine, "vocab_size", None))
    try:
        return ids, ctx.engine.tokenizer.decode(ids)
    except (ValueError, OverflowError, TypeError) as exc:
        raise APIError(400, f"prompt: the token ids cannot be decoded: {exc}", param="prompt") from None


def check_token_ids(ids: list[int], vocab_size: int | None) -> None:
    """Token ids must name tokens of the vocabulary (negative or huge ids would reach tensors and the tokenizer)."""
    upper = vocab_size if vocab_size is not None else _MAX_TOKEN_ID + 1
    for i, tid in enumerate(ids):
        if not 0 <= tid < upper:
            limit = f"the vocabulary's {vocab_size} tokens" if vocab_size is not None else f"0..{_MAX_TOKEN_ID}"
            raise APIError(400, f"prompt.{i}: token id {tid} is outside {limit}", param=f"prompt.{i}")


_MAX_TOKEN_ID = 2**31 - 1  # where the engine cannot say its vocabulary size


def check_unsupported(body: CompletionRequest) -> None:
    if body.n is not None and body.n > 1:
        raise APIError(400, f"n={body.n} is not supported: this server returns one choice per request (use n=1)",
                       param="n", code="unsupported_parameter")
    if body.best_of is not None and body.best_of > 1:
        raise APIError(400, "best_of > 1 is not supported", param="best_of", code="unsupported_parameter")
    if body.logprobs:
        raise APIError(400, "logprobs are not supported by this server", param="logprobs", code="unsupported_parameter")
    if body.suffix:
        raise APIError(400, "suffix (fill-in-the-middle) is not supported", param="suffix", code="unsupported_parameter")


def _chunk(cid: str, model: str, created: int, text: str, finish: str | None) -> dict[str, Any]:
    return {
        "id": cid, "object": "text_completion", "created": created, "model": model,
        "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": finish}],
    }


async def stream_completion(
    handle: TurnHandle, cid: str, model: str, created: int, echo: str, include_usage: bool
) -> AsyncGenerator[str, None]:
    if echo:
        yield data_event(_chunk(cid, model, created, echo, None))
    async for event in handle.events():
        if event is None:
            yield KEEPALIVE
        elif isinstance(event, TextEvent):
            yield data_event(_chunk(cid, model, created, event.text, None))
        elif isinstance(event, ErrorEvent):
            yield data_event(openai_error_body(error_for(event.error)))
            return
        elif isinstance(event, DoneEvent):
            outcome = event.outcome
            if outcome.finish_reason == "cancelled":
                return
            final = _chunk(cid, model, created, "", outcome.finish_reason)
            final["timings"] = outcome.timings()
            yield data_event(final)
            if include_usage:
                yield data_event({"id": cid, "object": "text_completion", "created": created, "model": model,
                                  "choices": [], "usage": usage_of(outcome)})
            yield DONE


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    received_at = time.perf_counter()
    ctx = context_of(request)
    body = validate(CompletionRequest, await read_json_object(request, ctx.settings.max_body_bytes))
    model = ctx.resolve_model(body.model)
    check_unsupported(body)
    ids, prompt_text = prompt_ids(ctx, body.prompt)
    max_tokens = ctx.max_new_tokens(body.max_tokens, len(ids), api="completions", param="max_tokens")
    turn = Turn(
        request=GenerationRequest(
            prompt_ids=ids, max_new_tokens=max_tokens, stop=tuple(stop_list(body.stop)),
            sampling=sampling_params(
                temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, min_p=body.min_p, seed=body.seed,
                presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
            ),
            use_prefix_cache=prefix_cache_wanted(request, body.cache_prompt),
        ),
        raw=True, received_at=received_at,
    )
    handle = ctx.runner.start(turn, "completions")
    cid, created = new_id("cmpl-"), now()
    echo = prompt_text if body.echo else ""
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return EventStreamResponse(stream_completion(handle, cid, model, created, echo, include_usage),
                                   on_close=handle.cancel)
    outcome = await handle.outcome_unless_disconnected(request)
    if outcome.finish_reason == "cancelled":
        return JSONResponse(openai_error_body(APIError(499, "client closed the request")), status_code=499)
    result = _chunk(cid, model, created, echo + outcome.content, outcome.finish_reason)
    result["usage"] = usage_of(outcome)
    result["timings"] = outcome.timings()
    return JSONResponse(result)
