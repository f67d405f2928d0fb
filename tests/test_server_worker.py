"""The generation worker: FIFO order, queued jobs that leave the queue, failures handed back, stop; and
through the server, a queued request whose client disconnects never runs and the worker keeps serving."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable

import httpx
import openai
import pytest

from dflash.server import ServerSettings, create_app
from dflash.server.worker import GenerationWorker, JobResult
from tests.server_helpers import FakeEngine, metric, serving, sse_events, wait_until

pytestmark = pytest.mark.timeout(60)


def collect() -> tuple[list[JobResult[int]], Callable[[JobResult[int]], None], threading.Event]:
    results: list[JobResult[int]] = []
    done = threading.Event()

    def on_done(result: JobResult[int]) -> None:
        results.append(result)
        done.set()

    return results, on_done, done


def test_jobs_run_in_arrival_order() -> None:
    worker = GenerationWorker()
    order: list[int] = []
    results, on_done, _ = collect()
    gate = threading.Event()

    def job(i: int) -> Callable[[Callable[[], bool]], int]:
        def run(_stop: Callable[[], bool]) -> int:
            gate.wait(5)
            order.append(i)
            return i
        return run

    for i in range(6):
        worker.submit(job(i), on_done)
    assert worker.queue_depth >= 5
    gate.set()
    assert wait_until(lambda: len(results) == 6)
    assert order == list(range(6)) and [r.value for r in results] == list(range(6))
    worker.stop()


def test_cancelled_queued_job_never_runs_and_running_job_stops() -> None:
    worker = GenerationWorker()
    ran: list[str] = []
    results, on_done, _ = collect()

    def slow(stop: Callable[[], bool]) -> int:
        ran.append("slow")
        for step in range(500):
            if stop():
                return step
            time.sleep(0.01)
        return 500

    def quick(_stop: Callable[[], bool]) -> int:
        ran.append("quick")
        return -1

    running = worker.submit(slow, on_done)
    queued = worker.submit(quick, on_done)
    assert wait_until(lambda: worker.busy)
    worker.cancel(queued)
    assert worker.queue_depth == 0
    assert results[0].dropped and results[0].value is None  # answered at once, without running
    worker.cancel(running)
    assert wait_until(lambda: len(results) == 2)
    assert results[1].value is not None and results[1].value < 500  # stopped at its next poll
    assert ran == ["slow"]
    worker.stop()


def test_failures_are_handed_back_and_the_worker_goes_on() -> None:
    worker = GenerationWorker()
    results, on_done, _ = collect()

    def boom(_stop: Callable[[], bool]) -> int:
        raise ValueError("bad tensor")

    worker.submit(boom, on_done)
    worker.submit(lambda _stop: 7, on_done)
    assert wait_until(lambda: len(results) == 2)
    assert isinstance(results[0].error, ValueError) and not results[0].dropped
    assert results[1].value == 7
    worker.stop()
    with pytest.raises(RuntimeError, match="shut down"):
        worker.submit(lambda _stop: 1, on_done)


def test_queued_request_whose_client_leaves_is_dropped() -> None:
    engine = FakeEngine(token_delay=0.01)
    engine.script("a" * 300, "never generated")
    with serving(create_app(engine, ServerSettings())) as running:
        url = running.url
        first_done = threading.Event()
        first_result: list[str] = []

        def first() -> None:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
            answer = client.chat.completions.create(model="any", messages=[{"role": "user", "content": "one"}])
            first_result.append(answer.choices[0].message.content or "")
            first_done.set()

        threading.Thread(target=first, daemon=True).start()
        assert engine.started.wait(10)
        with pytest.raises(httpx.ReadTimeout):  # queued behind the first; the client gives up
            httpx.post(f"{url}/v1/chat/completions", timeout=httpx.Timeout(30, read=0.5),
                       json={"model": "any", "messages": [{"role": "user", "content": "two"}]})
        assert wait_until(lambda: metric(url, "dflash_cancelled_total", api="chat", stage="queued") == 1)
        assert metric(url, "dflash_queue_depth") == 0
        assert first_done.wait(20) and first_result == ["a" * 300]
        third = httpx.post(f"{url}/v1/chat/completions", timeout=10,
                           json={"model": "any", "messages": [{"role": "user", "content": "three"}]})
        assert third.status_code == 200
    assert len(engine.prompts) == 2 and "two" not in "".join(engine.prompts)  # the dropped request never ran
    assert third.json()["choices"][0]["message"]["content"] == "never generated"


def test_streams_waiting_in_the_queue_get_keepalives() -> None:
    engine = FakeEngine(token_delay=0.01)
    engine.script("b" * 100, "second")
    with serving(create_app(engine, ServerSettings(keepalive_s=0.2))) as running:
        url = running.url
        blocker = threading.Thread(target=lambda: httpx.post(
            f"{url}/v1/chat/completions", timeout=30, json={"model": "any", "messages": [{"role": "user", "content": "1"}]}))
        blocker.start()
        assert engine.started.wait(10)
        body = {"model": "any", "messages": [{"role": "user", "content": "2"}], "stream": True}
        raw = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30).text
        blocker.join(30)
    assert raw.rstrip().endswith("data: [DONE]")
    assert raw.index(": keep-alive") < raw.index('"content": "s"')  # kept alive while waiting in the queue
    chunks = [json.loads(data) for _, data in sse_events(raw) if data != "[DONE]"]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == "second"
