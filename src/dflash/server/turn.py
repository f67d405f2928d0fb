"""One assistant turn on the worker thread: generate, split reasoning / text / tool calls, apply the stall
recoveries, and report events as they happen plus an `Outcome` at the end.

Every API builds a `Turn` and renders the same events (`TextEvent`, `ToolCallEvent`, then `DoneEvent` or
`ErrorEvent`) in its own wire format, streaming or not.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Literal

from dflash.generation.request import GenerationRequest, GenerationResult, GenerationStats
from dflash.server.conversation import ToolCall, ToolSpec
from dflash.server.engine_port import EnginePort, spec_mode
from dflash.server.reasoning import Channel, ReasoningSplitter, WhitespaceTrim
from dflash.server.stall import DegenerateRun, StallSettings, looks_like_action_preamble
from dflash.server.tool_calls import ToolCallStreamParser, ToolFormat, call_opening

log = logging.getLogger("dflash.server")

FinishReason = Literal["stop", "length", "tool_calls", "cancelled"]


@dataclass
class Turn:
    request: GenerationRequest
    tools: tuple[ToolSpec, ...] = ()  # tools the model was offered (parsed for when non-empty)
    tool_format: ToolFormat = "json"
    forced_prefix: str = ""  # prompt suffix that is part of the answer (a forced tool-call opening)
    starts_in_reasoning: bool = False
    raw: bool = False  # plain completion: text as generated, no reasoning / tool parsing
    stall_tool: str | None = None  # tool the stall continuation may open a call to
    received_at: float = field(default_factory=time.perf_counter)


@dataclass(frozen=True)
class TextEvent:
    channel: Channel
    text: str


@dataclass(frozen=True)
class ToolCallEvent:
    call: ToolCall


@dataclass
class Outcome:
    content: str
    reasoning: str
    tool_calls: list[ToolCall]
    finish_reason: FinishReason
    stop_sequence: str | None  # the stop string that ended the turn
    prompt_tokens: int
    completion_tokens: int
    stats: GenerationStats  # summed over the generations of the turn (two after a stall continuation)
    spec: str
    ttft_s: float | None = None
    queue_s: float = 0.0
    degenerate: bool = False
    continued: bool = False  # a stall continuation ran

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens of the turn's request restored from the prefix cache."""
        return self.stats.cached_tokens

    def timings(self) -> dict[str, object]:
        s = self.stats
        return {
            "prompt_n": self.prompt_tokens,
            "cache_n": self.cached_tokens,
            "predicted_n": self.completion_tokens,
            "queue_ms": round(self.queue_s * 1000, 3),
            "prefill_ms": round(s.prefill_s * 1000, 3),
            "decode_ms": round(s.decode_s * 1000, 3),
            "predicted_per_second": round(self.completion_tokens / s.decode_s, 3) if s.decode_s > 0 else 0.0,
            "spec": self.spec,
            "rounds": s.rounds,
            "draft_tokens": s.draft_tokens,
            "accepted_tokens": s.accepted_tokens,
            "acceptance_length": round(s.acceptance_length, 4),
            "acceptance_histogram": list(s.acceptance_histogram),  # [k] = rounds that accepted k drafts
            "fallbacks": s.fallbacks,
        }


@dataclass(frozen=True)
class DoneEvent:
    outcome: Outcome


@dataclass(frozen=True)
class ErrorEvent:
    error: Exception


TurnEvent = TextEvent | ToolCallEvent | DoneEvent | ErrorEvent
Emit = Callable[[TurnEvent], None]


class OutputPipeline:
    """Raw generated text -> reasoning / visible text / tool calls, emitted as events."""

    def __init__(self, turn: Turn, emit: Emit) -> None:
        self.emit = emit
        self.raw = turn.raw
        self.splitter = ReasoningSplitter(starts_in_reasoning=turn.starts_in_reasoning, enabled=not turn.raw)
        self.parser = ToolCallStreamParser(turn.tools) if turn.tools and not turn.raw else None
        self.trim: dict[Channel, WhitespaceTrim] = {"content": WhitespaceTrim(), "reasoning": WhitespaceTrim()}
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> None:
        if self.raw:
            if text:
                self.content.append(text)
                self.emit(TextEvent("content", text))
            return
        for channel, piece in self.splitter.feed(text):
            self._route(channel, piece)

    def finish(self) -> None:
        for channel, piece in self.splitter.finish():
            self._route(channel, piece)
        if self.parser is not None:
            for item in self.parser.finish():
                self._item(item)

    def _route(self, channel: Channel, piece: str) -> None:
        if channel == "content" and self.parser is not None:
            for item in self.parser.feed(piece):
                self._item(item)
        else:
            self._text(channel, piece)

    def _item(self, item: str | ToolCall) -> None:
        if isinstance(item, str):
            self._text("content", item)
        else:
            self.calls.append(item)
            self.trim["content"].reset_pending()
            self.emit(ToolCallEvent(item))

    def _text(self, channel: Channel, piece: str) -> None:
        visible = self.trim[channel].push(piece)
        if visible:
            (self.content if channel == "content" else self.reasoning).append(visible)
            self.emit(TextEvent(channel, visible))


def execute_turn(
    engine: EnginePort, turn: Turn, stall: StallSettings, emit: Emit, should_stop: Callable[[], bool]
) -> Outcome:
    """Run `turn` on the calling thread. Engine exceptions propagate (the caller reports them)."""
    pipeline = OutputPipeline(turn, emit)
    first_token_at: list[float] = []
    degenerate = DegenerateRun(stall.degenerate_run_tokens) if stall.degenerate_run_tokens > 0 else None
    tripped = [False]

    def on_text(text: str, ids: list[int]) -> None:
        if not first_token_at and ids:
            first_token_at.append(time.perf_counter())
        pipeline.feed(text)
        if degenerate is not None and degenerate.observe(ids):
            tripped[0] = True

    def stop() -> bool:
        return tripped[0] or should_stop()

    started = time.perf_counter()
    if turn.forced_prefix:
        pipeline.feed(turn.forced_prefix)
    request = turn.request
    results = [engine.generate(request, on_text=on_text, should_stop=stop)]
    carried = 0  # tokens of the first generation kept, plus the opening, after a stall continuation
    if _should_continue(turn, stall, results[0], pipeline, tripped[0], should_stop):
        follow = _continuation(engine, turn, results[0])
        if follow is not None:
            log.info("stall recovery: continuing a tool-less action preamble with a call to %s", turn.stall_tool)
            opening, follow_request = follow
            carried = len(follow_request.prompt_ids) - len(request.prompt_ids)
            pipeline.feed(opening)
            results.append(engine.generate(follow_request, on_text=on_text, should_stop=stop))
    pipeline.finish()
    last = results[-1]
    completion = carried + last.stats.completion_tokens
    finish: FinishReason
    if last.finish_reason == "cancelled":
        finish = "length" if tripped[0] else "cancelled"
    elif last.finish_reason == "stop" and pipeline.calls:
        finish = "tool_calls"
    else:
        finish = "length" if last.finish_reason == "length" else "stop"
    stop_sequence = last.stop_reason if last.finish_reason == "stop" and last.stop_reason != "eos" else None
    return Outcome(
        content="".join(pipeline.content),
        reasoning="".join(pipeline.reasoning),
        tool_calls=list(pipeline.calls),
        finish_reason=finish,
        stop_sequence=stop_sequence,
        prompt_tokens=len(request.prompt_ids),
        completion_tokens=completion,
        stats=merge_stats(results),
        spec=spec_mode(engine, request),
        ttft_s=(first_token_at[0] - turn.received_at) if first_token_at else None,
        queue_s=started - turn.received_at,
        degenerate=tripped[0],
        continued=len(results) > 1,
    )


def _continuation(engine: EnginePort, turn: Turn, first: GenerationResult) -> tuple[str, GenerationRequest] | None:
    """(call opening, request continuing the model's own output after it), or None without token budget."""
    assert turn.stall_tool is not None
    opening = call_opening(turn.tool_format, turn.stall_tool)
    opening_ids = list(engine.tokenizer.encode(opening))
    own_ids = first.token_ids[:-1] if first.stop_reason == "eos" else first.token_ids  # EOS gives way to the call
    budget = turn.request.max_new_tokens - len(own_ids) - len(opening_ids)
    if budget < 1:
        return None
    prompt_ids = [*turn.request.prompt_ids, *own_ids, *opening_ids]
    # the opening names the tool: a constraint on how the first generation opens its call no longer applies
    return opening, replace(
        turn.request, prompt_ids=prompt_ids, max_new_tokens=budget, min_tokens=0, constraint=None
    )


def merge_stats(results: list[GenerationResult]) -> GenerationStats:
    merged = GenerationStats(prompt_tokens=results[0].stats.prompt_tokens, cached_tokens=results[0].stats.cached_tokens)
    for result in results:
        s = result.stats
        merged.completion_tokens += s.completion_tokens
        merged.prefill_s += s.prefill_s
        merged.decode_s += s.decode_s
        merged.rounds += s.rounds
        merged.draft_tokens += s.draft_tokens
        merged.accepted_tokens += s.accepted_tokens
        merged.fallbacks += s.fallbacks
        merged.accepted_per_round.extend(s.accepted_per_round)
        for k, count in enumerate(s.acceptance_histogram):
            if len(merged.acceptance_histogram) <= k:
                merged.acceptance_histogram.append(0)
            merged.acceptance_histogram[k] += count
    return merged


def _should_continue(
    turn: Turn,
    stall: StallSettings,
    result: GenerationResult,
    pipeline: OutputPipeline,
    tripped: bool,
    should_stop: Callable[[], bool],
) -> bool:
    return (
        stall.tool_prefix
        and turn.stall_tool is not None
        and result.finish_reason == "stop"
        and result.stop_reason == "eos"
        and not tripped
        and not should_stop()
        and not pipeline.calls
        and looks_like_action_preamble("".join(pipeline.content))
    )
