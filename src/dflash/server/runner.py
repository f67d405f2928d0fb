"""Bridges the event loop and the generation worker: submit a `Turn`, then read its events (streaming) or
wait for its `Outcome`, cancelling the generation when the client goes away.

Events cross from the worker thread (or the engine loop thread, whose steps stream every request's text) to
the loop through an `EventRelay`, in order, waking the loop once per batch of them; the last event of every
turn is `DoneEvent` or `ErrorEvent`. Metrics and the "last used" time are recorded here, once
per turn, whatever way it ended.

A full worker queue is refused before anything is streamed: 429 (OpenAI APIs) or 529 (Anthropic) with a
Retry-After header. With a request timeout, a turn still running that long after its arrival is stopped
like a degenerate run is (`dflash.server.turn`): the client gets the text so far with finish reason
"length" (Anthropic: stop reason "max_tokens"); one whose time ran out while it waited never reaches the
engine and ends the same way, empty.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import replace

from starlette.requests import Request

from dflash.errors import GenerationError
from dflash.generation.request import GenerationStats
from dflash.server.engine_port import EnginePort
from dflash.server.errors import APIError, internal_error, overloaded
from dflash.server.event_relay import EventRelay
from dflash.server.metrics import Metrics
from dflash.server.stall import StallSettings
from dflash.server.turn import (
    DoneEvent,
    ErrorEvent,
    Outcome,
    TextEvent,
    ToolCallEvent,
    Turn,
    TurnEvent,
    execute_turn,
)
from dflash.server.worker import GenerationWorker, Job, JobResult, WorkerOverloaded

log = logging.getLogger("dflash.server")


class TurnHandle:
    def __init__(self, relay: EventRelay[TurnEvent], keepalive_s: float, *, flushed_per_step: bool = False) -> None:
        self.relay = relay
        self.keepalive_s = keepalive_s
        self.flushed_per_step = flushed_per_step  # streamed events wait for the engine's step to end (`flush_events`)
        self._events: deque[TurnEvent] = deque()  # delivered, not yet read
        self._waiter: asyncio.Future[bool] | None = None  # the reader waiting for events (True: some arrived)
        self.job: Job[Outcome] | None = None
        self.worker: GenerationWorker | None = None

    def push(self, event: TurnEvent) -> None:
        """Called on the worker thread, or on the engine loop thread from a step's output callbacks."""
        streamed = isinstance(event, TextEvent | ToolCallEvent)
        self.relay.push(self._receive, event, wait_for_flush=streamed and self.flushed_per_step)

    def _receive(self, events: list[TurnEvent]) -> None:
        """On the event loop: events the relay delivers, in order."""
        self._events.extend(events)
        _settle(self._waiter, True)

    def cancel(self) -> None:
        if self.job is not None and self.worker is not None and not self.job.done:
            self.worker.cancel(self.job)

    async def events(self) -> AsyncIterator[TurnEvent | None]:
        """Events up to and including the final one; None every `keepalive_s` without one."""
        loop = self.relay.loop
        while True:
            if not self._events:
                # a bare future and a timer rather than `asyncio.wait_for` (a task per wait): one wait per token
                self._waiter = waiter = loop.create_future()
                timer = loop.call_later(self.keepalive_s, _settle, waiter, False)
                try:
                    arrived = await waiter
                finally:
                    timer.cancel()
                    self._waiter = None
                if not arrived:
                    yield None
                    continue
            event = self._events.popleft()
            yield event
            if isinstance(event, DoneEvent | ErrorEvent):
                return

    async def outcome(self) -> Outcome:
        """The final outcome; raises `APIError` for a failure (400 for a bad request, 500 otherwise)."""
        async for event in self.events():
            if isinstance(event, DoneEvent):
                return event.outcome
            if isinstance(event, ErrorEvent):
                raise error_for(event.error)
        raise AssertionError("unreachable")

    async def outcome_unless_disconnected(self, request: Request) -> Outcome:
        """`outcome()`, cancelling the generation if the client disconnects meanwhile."""
        watcher = asyncio.ensure_future(_wait_for_disconnect(request))

        def on_watcher_done(task: asyncio.Future[None]) -> None:
            if task.cancelled():
                return
            if task.exception() is not None:
                log.debug("disconnect watcher failed", exc_info=task.exception())
            self.cancel()

        watcher.add_done_callback(on_watcher_done)
        try:
            return await self.outcome()
        finally:
            watcher.cancel()


def _settle(waiter: asyncio.Future[bool] | None, arrived: bool) -> None:
    if waiter is not None and not waiter.done():
        waiter.set_result(arrived)


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def shutting_down() -> APIError:
    return APIError(503, "the server is shutting down", kind="unavailable", code="shutting_down")


def error_for(exc: Exception) -> APIError:
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, GenerationError):
        return APIError(400, str(exc))
    return internal_error(exc)


class TurnRunner:
    def __init__(
        self,
        engine: EnginePort,
        worker: GenerationWorker,
        metrics: Metrics,
        stall: StallSettings,
        keepalive_s: float,
        request_timeout_s: float | None = None,
    ) -> None:
        self.engine, self.worker, self.metrics, self.stall = engine, worker, metrics, stall
        self.keepalive_s = keepalive_s
        self.request_timeout_s = request_timeout_s
        self.last_used_ms: int | None = None
        self._relay: EventRelay[TurnEvent] | None = None
        # set where every batched step of the engine ends with `flush_events` (`create_app` installs it as the
        # step observer of an engine that batches): streamed text then reaches the loop once per step
        self.flushed_per_step = False

    def _relay_for(self, loop: asyncio.AbstractEventLoop) -> EventRelay[TurnEvent]:
        if self._relay is None or self._relay.loop is not loop:
            self._relay = EventRelay(loop)
        return self._relay

    def flush_events(self) -> None:
        """Deliver the queued events (the engine's step observer calls it after every batched step: the streamed
        text of all requests reaches the event loop in one wake-up)."""
        relay = self._relay
        if relay is not None:
            relay.flush()

    def start(self, turn: Turn, api: str) -> TurnHandle:
        """Submit `turn`; raises `APIError` when the server is shutting down or its queue is full."""
        handle = TurnHandle(self._relay_for(asyncio.get_running_loop()), self.keepalive_s,
                            flushed_per_step=self.flushed_per_step)

        def run(should_stop: Callable[[], bool]) -> Outcome:
            return self._run(turn, handle, should_stop)

        def done(result: JobResult[Outcome]) -> None:
            self._finished(api, turn, handle, result)

        handle.worker = self.worker
        try:
            handle.job = self.worker.submit(run, done)
        except WorkerOverloaded as exc:
            self.metrics.observe_overloaded(api)
            detail = f"generating {exc.running}, {exc.waiting} waiting"
            raise overloaded(exc.retry_after_s, detail, anthropic=api == "messages") from None
        except RuntimeError:
            raise shutting_down() from None
        return handle

    def _run(self, turn: Turn, handle: TurnHandle, should_stop: Callable[[], bool]) -> Outcome:
        """The turn on a worker thread, held to the request timeout when there is one."""
        if self.request_timeout_s is None:
            return execute_turn(self.engine, turn, self.stall, handle.push, should_stop)
        deadline = turn.received_at + self.request_timeout_s

        def expired() -> bool:
            return time.perf_counter() >= deadline

        if expired():  # its time ran out while queued: answered at once, without a prefill
            self.metrics.timeouts.inc()
            return replace(_dropped_outcome(turn), finish_reason="length", queue_s=time.perf_counter() - turn.received_at)
        outcome = execute_turn(self.engine, turn, self.stall, handle.push, lambda: should_stop() or expired())
        if outcome.finish_reason == "cancelled" and not should_stop():  # stopped by the deadline, not the client
            self.metrics.timeouts.inc()
            return replace(outcome, finish_reason="length")
        return outcome

    def _finished(self, api: str, turn: Turn, handle: TurnHandle, result: JobResult[Outcome]) -> None:
        latency = time.perf_counter() - turn.received_at
        self.last_used_ms = int(time.time() * 1000)
        if result.queue_s is not None:
            self.metrics.observe_queue_wait(result.queue_s)
        if result.dropped and self.worker.closed:
            self.metrics.requests.labels(api, "unavailable").inc()
            handle.push(ErrorEvent(shutting_down()))
        elif result.dropped:
            self.metrics.observe_dropped(api)
            handle.push(DoneEvent(_dropped_outcome(turn)))
        elif result.error is not None:
            client_error = isinstance(result.error, GenerationError | APIError)
            if not client_error:
                log.error("generation failed (%s)", api, exc_info=result.error)
            self.metrics.observe_error(api, latency, client_error=client_error)
            handle.push(ErrorEvent(result.error))
        else:
            assert result.value is not None
            self.metrics.observe_outcome(api, result.value, latency)
            handle.push(DoneEvent(result.value))


def _dropped_outcome(turn: Turn) -> Outcome:
    """A turn that never reached the engine."""
    return Outcome(
        content="", reasoning="", tool_calls=[], finish_reason="cancelled", stop_sequence=None,
        prompt_tokens=len(turn.request.prompt_ids), completion_tokens=0,
        stats=GenerationStats(prompt_tokens=len(turn.request.prompt_ids)), spec="none",
    )
