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

from dflash.process_symbols import process_function

__all__ = ["release_thread_workers"]

OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: free the threads, keep what a restart needs


def release_thread_workers() -> bool:
    """Free the calling thread's OpenMP worker threads; returns whether the runtime did (it refuses inside a
    parallel region, and is absent with runtimes other than libgomp)."""
    pause = process_function("omp_pause_resource_all", (ctypes.c_int,), ctypes.c_int)  # libgomp, loaded by torch
    return pause is not None and pause(OMP_PAUSE_SOFT) == 0
