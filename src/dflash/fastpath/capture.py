"""CUDA graph capture in a process whose other threads use the GPU meanwhile.

A server's request threads prepare their requests (token choosers, constraint masks) on the GPU while the engine
loop captures a shape it meets for the first time. torch's default capture mode ("global") fails the capture on any
potentially unsafe CUDA call from any thread (an allocation, a synchronising copy); "thread_local" fails it only for
this thread's, and the capture stream, being non-blocking, takes no implicit dependency on the others' work.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch

T = TypeVar("T")

CAPTURE_MODE = "thread_local"

_captures = 0  # graphs captured in this process: a step that captured one is not a measure of its steady cost


def captures_made() -> int:
    """How many graphs `capture_graph` has captured so far in this process."""
    return _captures


def capture_graph(
    build: Callable[[], T], pool: Any, *, warmups: int = 1, device: torch.device | None = None,
    stream: torch.cuda.Stream | None = None,
) -> tuple[torch.cuda.CUDAGraph, T]:
    """Run `build` `warmups` times on a side stream (library handles, workspaces and kernel choices are made outside
    the capture), then capture one call of it into a graph drawing on `pool`. Returns the graph and that call's
    outputs (the tensors each replay rewrites)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(warmups):
            build()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode=CAPTURE_MODE):
        outputs = build()
    global _captures
    _captures += 1
    return graph, outputs
