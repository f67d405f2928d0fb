"""The event relay between generation threads and the event loop: order, and one wake-up per flushed batch."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest

from dflash.server.event_relay import EventRelay


class CountingLoop:
    """An event loop on its own thread that counts the wake-ups other threads ask of it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.wakeups = 0
        schedule = self.loop.call_soon_threadsafe

        def counted(callback, *args):  # type: ignore[no-untyped-def]
            self.wakeups += 1
            return schedule(callback, *args)

        self.loop.call_soon_threadsafe = counted  # type: ignore[method-assign]
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def settle(self) -> None:
        """Wait until the loop has run everything scheduled so far."""
        done = threading.Event()
        self.loop.call_soon_threadsafe(done.set)
        self.wakeups -= 1  # this one is the test's own
        assert done.wait(5)


@pytest.fixture
def running() -> Iterator[CountingLoop]:
    loop = CountingLoop()
    yield loop
    loop.loop.call_soon_threadsafe(loop.loop.stop)
    loop.thread.join(5)
    loop.loop.close()


def test_events_that_wait_for_the_flush_arrive_together_in_one_wakeup(running: CountingLoop) -> None:
    relay: EventRelay[str] = EventRelay(running.loop)
    first: list[list[str]] = []
    second: list[list[str]] = []
    for index in range(3):  # a step's output for two requests
        relay.push(first.append, f"a{index}", wait_for_flush=True)
        relay.push(second.append, f"b{index}", wait_for_flush=True)
    running.settle()
    assert first == [] and second == [] and running.wakeups == 0
    relay.flush()
    running.settle()
    assert first == [["a0", "a1", "a2"]] and second == [["b0", "b1", "b2"]]
    assert running.wakeups == 1
    relay.flush()  # nothing queued: no wake-up
    running.settle()
    assert running.wakeups == 1


def test_an_immediate_event_carries_the_waiting_ones_before_it(running: CountingLoop) -> None:
    relay: EventRelay[str] = EventRelay(running.loop)
    received: list[str] = []
    relay.push(received.extend, "x", wait_for_flush=True)
    relay.push(received.extend, "y", wait_for_flush=True)
    relay.push(received.extend, "z")  # a turn's final event: delivered now, after what was queued
    running.settle()
    assert received == ["x", "y", "z"]
    assert running.wakeups == 1


def test_pushes_from_many_threads_keep_each_threads_order(running: CountingLoop) -> None:
    relay: EventRelay[tuple[int, int]] = EventRelay(running.loop)
    received: list[tuple[int, int]] = []

    def produce(thread: int) -> None:
        for index in range(200):
            relay.push(received.extend, (thread, index))

    threads = [threading.Thread(target=produce, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    running.settle()
    assert len(received) == 800
    for thread_index in range(4):
        assert [i for t, i in received if t == thread_index] == list(range(200))
