"""The engine loop: one thread that runs batched steps while any request is active, fed by callers' threads.

`run(seq)` is called from any thread (the server's request threads, a benchmark's clients): it hands the sequence
to the loop and blocks until the sequence is done, its output streamed meanwhile from the loop thread through
its sink's callback. The loop admits newly submitted sequences at the start of every step, so a request that
arrives mid-generation joins the next step instead of waiting for the others to finish. Cancellation is per
request (its `should_stop`), checked at every step.

A request that arrives while nothing else is decoding or waiting can take the single-request path instead (`alone`:
the engine's single-request loops, on a GPU its device-resident graph replays, the fastest stream). It keeps it
until another request arrives: then it stops at its next round (`Yielded`) and continues in the batched core from
where it stands, its prompt extended by the tokens it has produced (the prefix cache serves the prompt's blocks
again), the same sink and chooser carrying its output and history on.
"""

from __future__ import annotations

import atexit
import logging
import threading
import weakref
from collections import deque
from collections.abc import Callable

from dflash.batch.core import BatchCore
from dflash.batch.sequence import Sequence
from dflash.generation.request import GenerationResult

log = logging.getLogger("dflash.batch")


class LoopStopped(RuntimeError):
    """The engine loop has shut down."""


class Yielded(Exception):
    """Raised inside a request's single-request run (from its `should_stop`) when another request arrives."""


# Runs a sequence through the single-request path on the loop thread: returns True once it is done (finished, failed
# or cancelled), False if it stopped with `Yielded` to continue in the batched core. Its argument: `yield_now()`.
AloneRun = Callable[[Sequence, Callable[[], bool]], bool]


class BatchLoop:
    def __init__(
        self, core: BatchCore, on_step: Callable[[int], None] | None = None, name: str = "dflash-engine",
        alone: AloneRun | None = None,
    ) -> None:
        self.core = core
        self.on_step = on_step
        self.alone = alone
        self._alone_seq: Sequence | None = None
        self._inbox: deque[Sequence] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()
        # A daemon thread still inside torch when the interpreter finalises can abort the process ("terminate
        # called without an active exception"): stop and join the loop first. A weak reference, so that an engine
        # dropped earlier is not kept alive by the hook.
        atexit.register(_stop_at_exit, weakref.ref(self))

    def run(self, seq: Sequence) -> GenerationResult:
        """Generate `seq` among the others; returns when it is done (raises its error, if it failed)."""
        self.core.add_check(seq)
        with self._cond:
            if self._closed:
                raise LoopStopped("the engine loop has shut down")
            self._inbox.append(seq)
            self._cond.notify()
        seq.done.wait()
        return seq.result()

    @property
    def running(self) -> int:
        return len(self.core.active) + (self._alone_seq is not None)

    @property
    def waiting(self) -> int:
        with self._cond:
            return len(self._inbox) + len(self.core.waiting)

    def stop(self, timeout: float = 30.0) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _loop(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._inbox and not self.core.active and not self.core.waiting and not self._closed:
                        self._cond.wait()
                    if self._closed:
                        break
                    lone = None
                    if self.alone is not None and len(self._inbox) == 1 and not self.core.active and not self.core.waiting:
                        lone = self._inbox.popleft()
                    while self._inbox:
                        self.core.add(self._inbox.popleft())
                if lone is not None:
                    self._run_alone(lone)
                    continue
                served = self.core.step()
                if served:
                    self._observe(served)
                if not served and self.core.waiting and not self.core.active:
                    # waiting sequences that cannot be admitted with nothing running: only memory held elsewhere
                    # could block them, which cannot happen (admission checks the whole pool); guard the spin
                    with self._cond:
                        self._cond.wait(0.01)
        except BaseException as exc:
            log.exception("engine loop stopped")
            error = exc if isinstance(exc, Exception) else LoopStopped(f"the engine loop stopped: {exc!r}")
            self.core.fail_all(error)
            raise
        finally:
            with self._cond:
                self._closed = True
                pending = list(self._inbox)
                self._inbox.clear()
            self.core.fail_all(LoopStopped("the engine loop has shut down"))
            for seq in pending:
                seq.finish(LoopStopped("the engine loop has shut down"))

    def _run_alone(self, seq: Sequence) -> None:
        """`seq` through the single-request path until it is done or another request arrives (then the rest of it
        joins the batched core)."""
        assert self.alone is not None
        self._alone_seq = seq

        def yield_now() -> bool:  # asked before each prefill chunk and round
            self._observe(1)  # as a step of one request: the text streamed since goes out now
            return bool(self._inbox) or self._closed

        try:
            done = self.alone(seq, yield_now)
        finally:
            self._alone_seq = None
            self._observe(1)  # the last round's text
        if done:
            return
        seq.resume_from_output()
        try:
            self.core.add(seq)
        except Exception as exc:  # it cannot be admitted (more memory than the pool): it ends, the loop goes on
            seq.finish(exc)

    def _observe(self, served: int) -> None:
        if self.on_step is not None:
            try:
                self.on_step(served)
            except Exception:  # an observer must not stop generation
                log.exception("step observer failed")


def _stop_at_exit(loop: weakref.ref[BatchLoop]) -> None:
    alive = loop()
    if alive is not None:
        alive.stop(timeout=10.0)
