"""The generation worker: one thread that runs jobs one at a time, in arrival order (FIFO).

The engine serves one request at a time and generation is blocking, so it runs here, off the event loop.
Each job gets a `should_stop` callable that turns true once `cancel()` is called (the client went away);
the engine polls it every decode round, so a cancelled generation ends within one round. A job cancelled
while still queued leaves the queue at once and never runs. Exceptions raised by a job are handed to its
`on_done` callback, never swallowed.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

log = logging.getLogger("dflash.server")

T = TypeVar("T")


@dataclass(frozen=True)
class JobResult(Generic[T]):
    value: T | None = None
    error: Exception | None = None
    dropped: bool = False  # cancelled before it started (or the worker shut down first)


class Job(Generic[T]):
    def __init__(self, fn: Callable[[Callable[[], bool]], T], on_done: Callable[[JobResult[T]], None]) -> None:
        self.fn = fn
        self.on_done = on_done
        self._stop = threading.Event()
        self._done_lock = threading.Lock()
        self.done = False
        self.started = False

    def should_stop(self) -> bool:
        return self._stop.is_set()

    @property
    def cancelled(self) -> bool:
        return self._stop.is_set()

    def _complete(self, result: JobResult[T]) -> None:
        with self._done_lock:
            if self.done:
                return
            self.done = True
        try:
            self.on_done(result)
        except Exception:  # a broken callback must not take the worker down
            log.exception("job completion callback failed")


class GenerationWorker:
    def __init__(self, name: str = "dflash-generation") -> None:
        self.name = name
        self._queue: deque[Job[Any]] = deque()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False
        self.current: Job[Any] | None = None

    # ---- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> None:
        with self._cond:
            if self._thread is not None or self._closed:
                return
            self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Drop queued jobs, ask the running one to stop, and wait for the thread."""
        with self._cond:
            self._closed = True
            dropped = list(self._queue)
            self._queue.clear()
            if self.current is not None:
                self.current._stop.set()
            self._cond.notify_all()
            thread = self._thread
        for job in dropped:
            job._stop.set()
            job._complete(JobResult(dropped=True))
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    # ---- jobs --------------------------------------------------------------------------------------
    def submit(self, fn: Callable[[Callable[[], bool]], T], on_done: Callable[[JobResult[T]], None]) -> Job[T]:
        job: Job[T] = Job(fn, on_done)
        self.start()
        with self._cond:
            if self._closed:
                raise RuntimeError("the generation worker has shut down")
            self._queue.append(job)
            self._cond.notify()
        return job

    def cancel(self, job: Job[Any]) -> None:
        """Stop `job`: a queued job leaves the queue now; a running one stops at its next poll."""
        job._stop.set()
        with self._cond:
            try:
                self._queue.remove(job)
            except ValueError:
                return
        job._complete(JobResult(dropped=True))

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def queue_depth(self) -> int:
        with self._cond:
            return len(self._queue)

    @property
    def busy(self) -> bool:
        return self.current is not None

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if self._closed and not self._queue:
                    return
                job = self._queue.popleft()
                self.current = job
            job.started = True
            result: JobResult[Any]
            try:
                result = JobResult(value=job.fn(job.should_stop))
            except Exception as exc:
                result = JobResult(error=exc)
            except BaseException as exc:  # the thread is going down: answer the job before it does
                job._complete(JobResult(error=RuntimeError(f"generation worker stopped: {exc!r}")))
                raise
            finally:
                with self._cond:
                    self.current = None
            job._complete(result)
