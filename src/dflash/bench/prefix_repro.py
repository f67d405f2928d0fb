"""Reproducer of the failure seen in the field with prefix caching and speculative decoding: answers that come
back empty once the prefix is served from the cache.

It runs a real agent loop against one server: every call resends the whole conversation, now grown by the
model's own previous answer and the next tool output of a synthetic session, so each call after the first should
reuse the previous prompt. It fails when any of those warm calls returns an empty answer or an error; with
`compare_cold` it also sends each prompt with the prefix cache switched off and fails on a different answer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from dflash.bench.agent_loop import OPT_OUT_HEADERS
from dflash.bench.chat_stream import stream_chat
from dflash.bench.synthetic_session import CountTokens, SessionShape, synthetic_session
from dflash.bench.transcript import Message, from_claude_code


@dataclass(frozen=True)
class ReproSettings:
    base_url: str
    model: str = "any"
    calls: int = 8
    max_tokens: int = 48
    compare_cold: bool = False
    shape: SessionShape = field(default_factory=lambda: SessionShape(max_prefix_tokens=6000))
    timeout_s: float = 600.0


def reproduce(settings: ReproSettings, count_tokens: CountTokens,
              on_call: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    session = from_claude_code(synthetic_session(settings.shape, count_tokens))
    outputs = [m["content"] for m in session.messages if m["role"] == "tool"]
    messages: list[Message] = [session.messages[0]]
    rows: list[dict[str, Any]] = []
    failures: list[str] = []
    with httpx.Client(timeout=settings.timeout_s) as client:
        for index in range(min(settings.calls, len(outputs) + 1)):
            body = {"model": settings.model, "messages": messages, "max_tokens": settings.max_tokens, "temperature": 0}
            warm = stream_chat(client, settings.base_url, body)
            row: dict[str, Any] = {"call": index, "messages": len(messages), **warm.as_dict()}
            if index and (warm.error or warm.empty):
                failures.append(f"call {index}: " + (warm.error or "empty answer"))
            if settings.compare_cold:
                cold = stream_chat(client, settings.base_url, {**body, "cache_prompt": False}, OPT_OUT_HEADERS)
                row["same_as_cold"] = cold.error is None and cold.answer() == warm.answer()
                if not row["same_as_cold"]:
                    failures.append(f"call {index}: the answer differs from the one without the prefix cache")
            rows.append(row)
            if on_call is not None:
                on_call(row)
            if warm.error or index >= len(outputs):
                break
            messages = [*messages, {"role": "assistant", "content": warm.answer()},
                        {"role": "user", "content": f"Tool output:\n{outputs[index]}"}]
    return {"calls": rows, "failures": failures, "passed": not failures}
