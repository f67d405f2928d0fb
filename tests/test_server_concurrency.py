"""The generation worker as a pool: jobs run side by side up to `concurrency`, start in arrival order, wait in a
bounded queue (full: `WorkerOverloaded` with a retry estimate), and each keeps its own cancellation."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from dflash.server.worker import GenerationWorker, Job, JobResult, WorkerOverloaded
from tests.server_helpers import wait_until

pytestmark = pytest.mark.timeout(60)

Fn = Callable[[Callable[[], bool]], int]


class Results:
    def __init__(self) -> None:
        self.items: list[JobResult[int]] = []
        self.lock = threading.Lock()

    def __call__(self, result: JobResult[int]) -> None:
        with self.lock:
            self.items.append(result)

    def __len__(self) -> int:
        with self.lock:
            return len(self.items)


def blocked(gate: threading.Event, value: int = 0) -> Fn:
    """A job that waits for `gate` (or its own stop) and returns `value`, or -1 when stopped."""
    def run(stop: Callable[[], bool]) -> int:
        while not gate.wait(0.01):
            if stop():
                return -1
        return value
    return run


def test_two_jobs_run_at_once_with_concurrency_two() -> None:
    worker = GenerationWorker(concurrency=2)
    both_in = threading.Barrier(2, timeout=5)  # broken (an error) unless two jobs are inside at the same time
    results = Results()

    def meet(_stop: Callable[[], bool]) -> int:
        both_in.wait()
        return 1

    worker.submit(meet, results)
    worker.submit(meet, results)
    assert wait_until(lambda: len(results) == 2)
    assert [r.value for r in results.items] == [1, 1] and all(r.error is None for r in results.items)
    worker.stop()


def test_one_thread_runs_jobs_one_at_a_time() -> None:
    worker = GenerationWorker(concurrency=1)
    gate, results = threading.Event(), Results()
    worker.submit(blocked(gate, 1), results)
    worker.submit(blocked(gate, 2), results)
    assert wait_until(lambda: worker.running == 1 and worker.queue_depth == 1)
    time.sleep(0.1)
    assert worker.running == 1  # the second waits although the first is blocked
    gate.set()
    assert wait_until(lambda: len(results) == 2)
    assert [r.value for r in results.items] == [1, 2]
    worker.stop()


def test_jobs_start_in_arrival_order_and_report_their_queue_wait() -> None:
    worker = GenerationWorker(concurrency=2)
    gate, results = threading.Event(), Results()
    jobs = [worker.submit(blocked(gate, i), results) for i in range(8)]
    assert wait_until(lambda: worker.running == 2)
    assert worker.queue_depth == 6 and not any(j.started for j in jobs[2:])
    time.sleep(0.2)
    gate.set()
    assert wait_until(lambda: len(results) == 8)
    starts = [j.started_at for j in jobs]
    assert all(s is not None for s in starts)
    assert sorted(range(8), key=lambda i: starts[i] or 0.0) == list(range(8))
    waits = {r.value: r.queue_s or 0.0 for r in results.items}
    assert all(waits[i] >= 0.2 for i in range(2, 8))  # the later six waited for the gate
    assert max(waits[0], waits[1]) < min(waits[i] for i in range(2, 8))
    worker.stop()


def test_a_full_queue_refuses_with_a_retry_delay_until_a_slot_frees() -> None:
    worker = GenerationWorker(concurrency=2, max_queue=1)
    gate, results = threading.Event(), Results()
    for i in range(3):  # two running, one waiting
        worker.submit(blocked(gate, i), results)
    assert wait_until(lambda: worker.running == 2)
    with pytest.raises(WorkerOverloaded) as refused:
        worker.submit(blocked(gate, 9), results)
    assert (refused.value.running, refused.value.waiting) == (2, 1)
    assert refused.value.retry_after_s == 1  # nothing finished yet and the running jobs are young: the minimum
    gate.set()
    assert wait_until(lambda: len(results) == 3)
    worker.submit(lambda _stop: 7, results)
    assert wait_until(lambda: len(results) == 4) and results.items[-1].value == 7
    worker.stop()


def test_no_waiting_room_refuses_as_soon_as_every_thread_is_busy() -> None:
    worker = GenerationWorker(concurrency=1, max_queue=0)
    gate, results = threading.Event(), Results()
    worker.submit(blocked(gate), results)
    with pytest.raises(WorkerOverloaded):  # counted at once, even before the thread has picked the job up
        worker.submit(blocked(gate), results)
    gate.set()
    worker.stop()


def test_the_retry_delay_follows_the_recent_job_length() -> None:
    worker = GenerationWorker(concurrency=1, max_queue=2)
    results = Results()

    def half_second(_stop: Callable[[], bool]) -> int:
        time.sleep(0.5)
        return 0

    worker.submit(half_second, results)
    assert wait_until(lambda: len(results) == 1)
    gate = threading.Event()
    for _ in range(3):  # one running, two waiting
        worker.submit(blocked(gate), results)
    with pytest.raises(WorkerOverloaded) as refused:
        worker.submit(blocked(gate), results)
    # 0.5 s per job x (2 waiting + 1 running) / 1 thread = 1.5 s, rounded up
    assert refused.value.retry_after_s == 2
    gate.set()
    worker.stop()


def test_cancelling_a_queued_job_drops_it_and_frees_its_place() -> None:
    worker = GenerationWorker(concurrency=1, max_queue=1)
    gate, results = threading.Event(), Results()
    ran: list[str] = []

    def never(_stop: Callable[[], bool]) -> int:
        ran.append("never")
        return 0

    worker.submit(blocked(gate, 1), results)
    queued = worker.submit(never, results)
    worker.cancel(queued)
    assert len(results) == 1 and results.items[0].dropped and results.items[0].queue_s is None
    worker.submit(blocked(gate, 2), results)  # the cancelled job's place is free again
    gate.set()
    assert wait_until(lambda: len(results) == 3)
    assert [r.value for r in results.items[1:]] == [1, 2] and ran == []
    worker.stop()


def test_cancelling_one_running_job_leaves_the_other_running() -> None:
    worker = GenerationWorker(concurrency=2)
    gate, results = threading.Event(), Results()
    first = worker.submit(blocked(gate, 1), results)
    worker.submit(blocked(gate, 2), results)
    assert wait_until(lambda: worker.running == 2)
    worker.cancel(first)
    assert wait_until(lambda: len(results) == 1)
    assert results.items[0].value == -1 and worker.running == 1  # stopped at its next poll, the other goes on
    gate.set()
    assert wait_until(lambda: len(results) == 2) and results.items[1].value == 2
    worker.stop()


def test_stop_drops_queued_jobs_and_stops_every_running_one() -> None:
    worker = GenerationWorker(concurrency=2)
    gate, results = threading.Event(), Results()
    jobs: list[Job[int]] = [worker.submit(blocked(gate, i), results) for i in range(5)]
    assert wait_until(lambda: worker.running == 2)
    worker.stop(timeout=10)
    assert len(results) == 5
    dropped = [r for r in results.items if r.dropped]
    stopped = [r for r in results.items if not r.dropped]
    assert len(dropped) == 3 and [r.value for r in stopped] == [-1, -1]
    assert all(j.done for j in jobs) and not any(j.started for j in jobs[2:])
    with pytest.raises(RuntimeError, match="shut down"):
        worker.submit(blocked(gate), results)


def test_bad_pool_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="concurrency"):
        GenerationWorker(concurrency=0)
    with pytest.raises(ValueError, match="max_queue"):
        GenerationWorker(max_queue=-1)
