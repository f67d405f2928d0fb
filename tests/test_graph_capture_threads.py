"""A CUDA graph captured while other threads of the process allocate, launch and synchronise on the GPU (a server's
request threads preparing requests while the engine loop captures a new shape) is captured and replays correctly."""

from __future__ import annotations

import threading

import pytest
import torch

from dflash.fastpath.capture import capture_graph

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


class GPUTraffic:
    """Another thread allocating new sizes, launching on its own (default) stream and reading results back, until
    stopped; it counts its rounds and keeps the first error it met."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.rounds = 0
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            while not self.stop.is_set():
                size = 256 + 64 * (self.rounds % 16)
                y = torch.full((size, size), 1.0 / size, device="cuda")  # not the random generator: a capture holds it
                (y @ y).sum().item()
                self.rounds += 1
        except BaseException as exc:  # reported by the test
            self.error = exc

    def __enter__(self) -> GPUTraffic:
        self.thread.start()
        while self.rounds < 3 and self.error is None:
            pass
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=60)


def test_a_capture_survives_other_threads_using_the_gpu() -> None:
    torch.manual_seed(0)
    x = torch.randn(256, 256, device="cuda") / 16

    def build() -> torch.Tensor:
        h = x
        for _ in range(300):
            h = torch.tanh(h @ x + 0.5)
        return h

    with GPUTraffic() as traffic:
        before = traffic.rounds
        graphs = [capture_graph(build, torch.cuda.graph_pool_handle(), warmups=2) for _ in range(4)]
        during = traffic.rounds - before
    assert traffic.error is None, traffic.error
    assert during > 0  # the other thread did run during the captures
    expected = build()
    for graph, out in graphs:
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, expected)
