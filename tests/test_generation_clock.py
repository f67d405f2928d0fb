"""Prefill spans wait for the device's queued work before reading the clock (CUDA only queues kernels)."""

from __future__ import annotations

import time

import pytest
import torch

from dflash.generation.clock import elapsed_since


def test_elapsed_since_waits_for_a_cuda_device_only(monkeypatch: pytest.MonkeyPatch) -> None:
    waited: list[torch.device | None] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: waited.append(device))
    started = time.perf_counter()
    time.sleep(0.01)
    assert elapsed_since(started, torch.device("cpu")) >= 0.01
    assert waited == []
    device = torch.device("cuda", 1)
    assert elapsed_since(started, device) >= 0.01
    assert waited == [device]
