"""Releasing the calling thread's OpenMP workers once its share of the compute is over.

The CPU kernels (and torch's own CPU operations) split each product over OpenMP threads: one team per calling
thread, whose workers wait for the next parallel region by spinning briefly, then sleeping. libgomp shortens that
spin to almost nothing as soon as the process holds more OpenMP threads than there are CPUs, and a team left
behind by another thread counts. The model is loaded on one thread and decodes on another (the engine loop, a
server worker), so on 2 cores the loaded thread's idle team made every product of the decoding thread wake its
workers from sleep: a one-token step of the default model took twice as long as on the loading thread itself
(results/README.md, "CPU: the decoding thread's OpenMP workers"). `release_thread_workers()` frees the calling
thread's team (`omp_pause_resource_all`, OpenMP 5.0); a later parallel region on that thread makes a new one.
Without libgomp's symbol (another OpenMP runtime) it does nothing.
"""

from __future__ import annotations

import ctypes
import logging
from functools import cache

__all__ = ["release_thread_workers"]

log = logging.getLogger(__name__)

OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: free the threads, keep what a restart needs


@cache
def _pause_all() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    try:
        pause = ctypes.CDLL(None).omp_pause_resource_all  # the runtime torch loaded, in the global namespace
    except (AttributeError, OSError):
        log.debug("no omp_pause_resource_all in this process: OpenMP workers are not released")
        return None
    pause.argtypes = [ctypes.c_int]
    pause.restype = ctypes.c_int
    return pause


def release_thread_workers() -> bool:
    """Free the calling thread's OpenMP worker threads; returns whether the runtime did (it refuses inside a
    parallel region, and is absent with runtimes other than libgomp)."""
    pause = _pause_all()
    return pause is not None and pause(OMP_PAUSE_SOFT) == 0
