"""The generation worker: a pool of `concurrency` threads that start jobs in arrival order (FIFO), with a
bounded wait queue in front of it.

Generation is blocking, so it runs here, off the event loop. With `concurrency > 1` several jobs call the
engine at once (it batches them into one decoding step); with 1 they run one at a time. At most `max_queue`
jobs wait beyond the running ones; `submit` past that raises `WorkerOverloaded` with a suggested retry delay.

Each job gets a `should_stop` callable that turns true once `cancel()` is called (the client went away);
the engine polls it every decode round, so a cancelled generation ends within one round. A job cancelled
while still queued leaves the queue at once and never runs. Exceptions raised by a job are handed to its
`on_done` callback, never swallowed.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

log = logging.getLogger("dflash.server")

T = TypeVar("T")

RETRY_AFTER_MIN_S = 1
RETRY_AFTER_MAX_S = 60  # the OpenAI and Anthropic SDKs honour Retry-After only up to a minute or two
_RECENT_JOBS = 32  # completed jobs whose durations make the retry estimate


class WorkerOverloaded(Exception):
    """The wait queue is full; the client should come back after `retry_after_s` seconds."""

    def __init__(self, retry_after_s: int, waiting: int, running: int) -> None:
        super().__init__(f"generating {running}, {waiting} waiting; retry in {retry_after_s} s")
        self.retry_after_s, self.waiting, self.running = retry_after_s, waiting, running


@dataclass(frozen=True)
class JobResult(Generic[T]):
    value: T | None = None
    error: Exception | None = None
    dropped: bool = False  # cancelled before it started (or the worker shut down first)
    queue_s: float | None = None  # submit to start on a pool thread (None: it never started)


class Job(Generic[T]):
    def __init__(self, fn: Callable[[Callable[[], bool]], T], on_done: Callable[[JobResult[T]], None]) -> None:
        self.fn = fn
        self.on_done = on_done
        self._stop = threading.Event()
        self._done_lock = threading.Lock()
        self.done = False
        self.started = False
        self.submitted_at = time.perf_counter()
        self.started_at: float | None = None

    def should_stop(self) -> bool:
        return self._stop.is_set()

    @property
    def cancelled(self) -> bool:
        return self._stop.is_set()

    @property
    def queue_wait_s(self) -> float | None:
        """Seconds from `submit` to the start on a pool thread (None until it starts)."""
        return None if self.started_at is None else self.started_at - self.submitted_at

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
    def __init__(
        self, name: str = "dflash-generation", *, concurrency: int = 1, max_queue: int | None = None
    ) -> None:
        if concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, got {concurrency}")
        if max_queue is not None and max_queue < 0:
            raise ValueError(f"max_queue must not be negative, got {max_queue}")
        self.name = name
        self.concurrency = concurrency
        self.max_queue = max_queue
        self._queue: deque[Job[Any]] = deque()
        self._running: list[Job[Any]] = []
        self._durations: deque[float] = deque(maxlen=_RECENT_JOBS)
        self._cond = threading.Condition()
        self._threads: list[threading.Thread] = []
        self._closed = False

    # ---- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> None:
        with self._cond:
            if self._threads or self._closed:
                return
            for i in range(self.concurrency):
                name = self.name if self.concurrency == 1 else f"{self.name}-{i}"
                thread = threading.Thread(target=self._loop, name=name, daemon=True)
                self._threads.append(thread)
                thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Drop queued jobs, ask the running ones to stop, and wait for the threads (`timeout` in all)."""
        with self._cond:
            self._closed = True
            dropped = list(self._queue)
            self._queue.clear()
            for job in self._running:
                job._stop.set()
            self._cond.notify_all()
            threads = list(self._threads)
        for job in dropped:
            job._stop.set()
            job._complete(JobResult(dropped=True))
        deadline = time.monotonic() + timeout
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))

    # ---- jobs --------------------------------------------------------------------------------------
    def submit(self, fn: Callable[[Callable[[], bool]], T], on_done: Callable[[JobResult[T]], None]) -> Job[T]:
        """Queue `fn`; raises `WorkerOverloaded` when the queue is full, RuntimeError after `stop()`."""
        job: Job[T] = Job(fn, on_done)
        self.start()
        with self._cond:
            if self._closed:
                raise RuntimeError("the generation worker has shut down")
            if self._full_locked():
                raise WorkerOverloaded(self._retry_after_locked(), len(self._queue), len(self._running))
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

    def _full_locked(self) -> bool:
        if self.max_queue is None:
            return False
        # running + queued, not the queue alone: a job just handed to an idle thread counts either way
        return len(self._queue) + len(self._running) >= self.concurrency + self.max_queue

    def _retry_after_locked(self) -> int:
        """Seconds until the jobs waiting now have started, rounded up and clamped to 1..60.

        The recent mean job duration times the jobs that must end first (those waiting, plus one running to
        make room) over the threads working them off. Erring long, so that refused clients come back spread
        over the time the queue needs rather than all at the first free slot. Without a finished job yet, the
        oldest running job's age stands in for the mean (a lower bound of it)."""
        now = time.perf_counter()
        if self._durations:
            mean = sum(self._durations) / len(self._durations)
        else:
            mean = max((now - (j.started_at or now) for j in self._running), default=0.0)
        # counted over running + queued: a job handed to a thread that has not picked it up yet counts the same
        ahead = max(1, len(self._queue) + len(self._running) - self.concurrency + 1)
        estimate = mean * ahead / self.concurrency
        return int(min(RETRY_AFTER_MAX_S, max(RETRY_AFTER_MIN_S, math.ceil(estimate))))

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def queue_depth(self) -> int:
        """Jobs waiting for a thread."""
        with self._cond:
            return len(self._queue)

    @property
    def running(self) -> int:
        """Jobs running now."""
        with self._cond:
            return len(self._running)

    @property
    def busy(self) -> bool:
        return self.running > 0

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if self._closed and not self._queue:
                    return
                job = self._queue.popleft()
                self._running.append(job)
                job.started_at = time.perf_counter()
            job.started = True
            result: JobResult[Any]
            try:
                result = JobResult(value=job.fn(job.should_stop), queue_s=job.queue_wait_s)
            except Exception as exc:
                result = JobResult(error=exc, queue_s=job.queue_wait_s)
            except BaseException as exc:  # the thread is going down: answer the job before it does
                job._complete(JobResult(error=RuntimeError(f"generation worker stopped: {exc!r}")))
                raise
            finally:
                with self._cond:
                    self._running.remove(job)
                    if not job.cancelled:  # a job its client left says nothing of how long jobs take
                        self._durations.append(time.perf_counter() - (job.started_at or 0.0))
            job._complete(result)
