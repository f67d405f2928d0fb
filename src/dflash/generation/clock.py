"""Wall-clock spans of device work, for the statistics a generation reports."""

from __future__ import annotations

import time

import torch


def elapsed_since(started: float, device: torch.device) -> float:
    """Seconds since `started` (a `time.perf_counter()` reading) once the work queued on `device` has finished. On
    CUDA the host only queues kernels: a span read without waiting measures their launches, not their work (a
    512-token prefill read 0.7 ms that way where it takes 5 ms). Callers read it where the next step would wait
    for the device anyway (the first token's choice), so the wait costs nothing."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started
