"""Turn events from generation threads to the event loop, with as few wake-ups of the loop as possible.

Every wake-up of the event loop from another thread (`call_soon_threadsafe`) writes to the loop's self-pipe and
hands the GIL over: the loop thread wakes, takes the GIL at the writer's next release, and the writer then waits
for it back. Under the batched engine the writer is the engine loop thread, pushing one event per request per
step from its sinks' callbacks; one wake-up each made that hand-off a large part of a step (the engine thread
spent more time in the pipe write than in its forward on a small model, `benchmarks/batch_loop_overhead.py
--path server`).

So events are queued here and the loop is woken once per batch of them. A streamed event of a batched engine
(`wait_for_flush`: pushed from a step's output callbacks; the app's step observer calls `flush` after every step)
waits in the queue for that flush: one wake-up per step for every request's text. Any other event (a
single-request generation's text, a turn's final event) wakes the loop now, unless a wake-up is already on its
way; it carries every event queued before it, in order. A turn's last event (`DoneEvent` or `ErrorEvent`) is
pushed by its worker thread after the generation returns, so nothing of a turn waits past its end.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")
Receiver = Callable[[list[T]], None]  # called on the loop with a turn's events, in order


class EventRelay(Generic[T]):
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._lock = threading.Lock()
        self._pending: list[tuple[Receiver[T], T]] = []
        self._wake_scheduled = False

    def push(self, receiver: Receiver[T], event: T, *, wait_for_flush: bool = False) -> None:
        """Queue `event` for `receiver` (any thread): delivered at the next `flush` when `wait_for_flush`, else as
        soon as the loop runs."""
        with self._lock:
            self._pending.append((receiver, event))
            if wait_for_flush or self._wake_scheduled:
                return
            self._wake_scheduled = True
        self._wake()

    def flush(self) -> None:
        """Deliver everything queued (one wake-up of the loop at most)."""
        with self._lock:
            if not self._pending or self._wake_scheduled:
                return
            self._wake_scheduled = True
        self._wake()

    def _wake(self) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: the server is shutting down
            self.loop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:
        """On the loop: hand every queued event to its receiver, one call per receiver with its events in order."""
        with self._lock:
            pending, self._pending = self._pending, []
            self._wake_scheduled = False
        batches: dict[Receiver[T], list[T]] = {}
        for receiver, event in pending:
            batches.setdefault(receiver, []).append(event)
        for receiver, events in batches.items():
            receiver(events)
