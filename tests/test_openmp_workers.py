"""`release_thread_workers`: the calling thread's OpenMP team is freed (its worker threads end) and the next parallel
region builds a new one, with the same results; the engine's loader releases the loading thread's team."""

from __future__ import annotations

import ctypes
import os
import time
from pathlib import Path

import pytest
import torch

from dflash.kernels.openmp import release_thread_workers
from dflash.process_symbols import process_function

needs_libgomp = pytest.mark.skipif(
    process_function("omp_pause_resource_all", (ctypes.c_int,), ctypes.c_int) is None,
    reason="no libgomp omp_pause_resource_all in this process",
)


def os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def settled_threads(expected: int, timeout: float = 5.0) -> int:
    """The process's thread count once it reaches `expected` (worker threads end asynchronously), or at timeout."""
    deadline = time.monotonic() + timeout
    while (count := os_threads()) != expected and time.monotonic() < deadline:
        time.sleep(0.01)
    return count


def parallel_work() -> torch.Tensor:
    x = torch.arange(1 << 22, dtype=torch.float32)
    return torch.sin(x).sum()  # large enough for an OpenMP parallel region on every thread count


@needs_libgomp
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs /proc")
def test_the_thread_team_is_freed_and_rebuilt() -> None:
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        first = parallel_work()
        with_team = os_threads()
        assert release_thread_workers()
        assert settled_threads(with_team - 1) == with_team - 1  # the one worker of a two-thread team ended
        assert torch.equal(parallel_work(), first)  # a new team, the same sum
        assert os_threads() == with_team
    finally:
        torch.set_num_threads(previous)


@needs_libgomp
def test_release_without_a_team_is_harmless() -> None:
    assert release_thread_workers()
    assert release_thread_workers()
