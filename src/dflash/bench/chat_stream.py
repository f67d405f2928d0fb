"""One streamed OpenAI chat completion, timed from the client: time to first token, total time, tokens, answer.

Works against any OpenAI-compatible server. Token counts come from the final `usage` chunk (asked for with
`stream_options.include_usage`); a server that sends none gets its completion tokens counted as the number of
deltas that carried output (exact for servers that send one token per delta, a lower bound otherwise), and its
prompt and cached tokens reported as unknown.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass
class CallRecord:
    ttft_s: float | None  # request sent -> first delta with output (text, reasoning or a tool call)
    total_s: float  # request sent -> end of the stream
    prompt_tokens: int | None
    completion_tokens: int
    cached_tokens: int | None
    usage_reported: bool
    text: str
    tool_calls: list[dict[str, str]] = field(default_factory=list)  # [{"name", "arguments"}] in call order
    finish_reason: str | None = None
    error: str | None = None
    timings: dict[str, Any] | None = None  # the server's own `timings` (dflash, llama.cpp), when it sends them

    @property
    def empty(self) -> bool:
        """An answer with no visible text and no tool call (errors are counted apart)."""
        return self.error is None and not self.text.strip() and not self.tool_calls

    def answer(self) -> str:
        """Text and tool calls in one string, to compare the answers of two servers."""
        calls = "".join(f"\n<call {c['name']} {c['arguments']}>" for c in self.tool_calls)
        return self.text + calls

    def as_dict(self) -> dict[str, Any]:
        return {
            "ttft_s": None if self.ttft_s is None else round(self.ttft_s, 4), "total_s": round(self.total_s, 4),
            "prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens, "usage_reported": self.usage_reported,
            "finish_reason": self.finish_reason, "empty": self.empty, "error": self.error, "answer": self.answer(),
            "acceptance_length": (self.timings or {}).get("acceptance_length"),
        }


class _Accumulator:
    def __init__(self, started: float) -> None:
        self.started = started
        self.first: float | None = None
        self.text: list[str] = []
        self.calls: dict[int, dict[str, str]] = {}
        self.output_deltas = 0
        self.usage: dict[str, Any] | None = None
        self.finish: str | None = None
        self.error: str | None = None
        self.timings: dict[str, Any] | None = None

    def chunk(self, data: dict[str, Any]) -> None:
        if "error" in data and not data.get("choices"):
            error = data["error"]
            self.error = str(error.get("message") if isinstance(error, dict) else error)
            return
        if data.get("usage"):
            self.usage = data["usage"]
        if isinstance(data.get("timings"), dict):
            self.timings = data["timings"]
        for choice in data.get("choices") or []:
            delta = choice.get("delta") or {}
            produced = False
            if delta.get("content"):
                self.text.append(delta["content"])
                produced = True
            if delta.get("reasoning_content"):
                produced = True
            for call in delta.get("tool_calls") or []:
                slot = self.calls.setdefault(int(call.get("index", len(self.calls))), {"name": "", "arguments": ""})
                function = call.get("function") or {}
                slot["name"] += function.get("name") or ""
                slot["arguments"] += function.get("arguments") or ""
                produced = True
            if produced:
                self.output_deltas += 1
                if self.first is None:
                    self.first = time.perf_counter()
            if choice.get("finish_reason"):
                self.finish = choice["finish_reason"]

    def record(self, ended: float) -> CallRecord:
        usage = self.usage or {}
        details = usage.get("prompt_tokens_details") or {}
        return CallRecord(
            ttft_s=None if self.first is None else self.first - self.started,
            total_s=ended - self.started,
            prompt_tokens=usage.get("prompt_tokens"),
            completion_tokens=int(usage.get("completion_tokens", self.output_deltas)),
            cached_tokens=details.get("cached_tokens") if self.usage else None,
            usage_reported=self.usage is not None,
            text="".join(self.text),
            tool_calls=[self.calls[i] for i in sorted(self.calls)],
            finish_reason=self.finish,
            error=self.error,
            timings=self.timings,
        )


def stream_chat(client: httpx.Client, base_url: str, body: dict[str, Any],
                headers: dict[str, str] | None = None) -> CallRecord:
    """POST `body` (made streaming, usage requested) to {base_url}/v1/chat/completions and time it."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    acc = _Accumulator(started)
    try:
        with client.stream("POST", f"{base_url.rstrip('/')}/v1/chat/completions", json=body, headers=headers) as response:
            if response.status_code != 200:
                response.read()
                acc.error = f"HTTP {response.status_code}: {response.text[:300]}"
            else:
                for line in response.iter_lines():
                    if not line.startswith("data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == "[DONE]":
                        break
                    acc.chunk(json.loads(payload))
    except httpx.HTTPError as exc:
        acc.error = f"{type(exc).__name__}: {exc}"
    return acc.record(time.perf_counter())
