"""Closed-loop streaming HTTP clients in a process of their own, for `batch_loop_overhead.py --path http`.

The clients run outside the server's process, as real clients do, so their own Python (reading the stream) does
not hold the server's GIL. `N` threads share the requests; each sends its next `POST /v1/completions` (token-id
prompt, greedy, streamed) when its previous stream has ended, and records its TTFT (first text chunk) and latency.
"""

from __future__ import annotations

import json
import multiprocessing
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StreamTiming:
    ttft_s: float
    latency_s: float
    chunks: int  # text chunks received


def _stream_one(client: Any, url: str, prompt: list[int], max_tokens: int) -> StreamTiming:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True}
    started = time.perf_counter()
    first: float | None = None
    chunks = 0
    with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[6:]).get("choices") or [{}]
            if choices[0].get("text"):
                chunks += 1
                if first is None:
                    first = time.perf_counter()
    ended = time.perf_counter()
    return StreamTiming((first or ended) - started, ended - started, chunks)


def _client_process(url: str, prompts: list[list[int]], clients: int, requests: int, max_tokens: int,
                    control: Any, results: Any) -> None:
    import httpx

    local = threading.local()

    def one(index: int) -> StreamTiming:
        if not hasattr(local, "client"):  # one connection per client thread, kept alive between its requests
            # without TCP_NODELAY the request body waits behind Nagle's algorithm for the server's delayed ACK of
            # the headers (about 40 ms on Linux), which would swamp the TTFT measured here
            nodelay = [(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]
            local.client = httpx.Client(timeout=120.0, transport=httpx.HTTPTransport(socket_options=nodelay))
        return _stream_one(local.client, url, prompts[index % len(prompts)], max_tokens)

    with ThreadPoolExecutor(max_workers=clients) as pool:
        list(pool.map(one, range(clients)))  # warm-up: connections open, every client's first request served
        results.put("ready")
        while control.get() == "go":
            started = time.perf_counter()
            timings = list(pool.map(one, range(requests)))
            wall = time.perf_counter() - started
            results.put((wall, [(t.ttft_s, t.latency_s, t.chunks) for t in timings]))


class StreamingClients:
    """`clients` closed-loop streaming clients in a child process: each `run()` times one batch of `requests`."""

    def __init__(self, url: str, prompts: list[list[int]], *, clients: int, requests: int, max_tokens: int) -> None:
        context = multiprocessing.get_context("spawn")
        self._control, self._results = context.Queue(), context.Queue()
        self._process = context.Process(
            target=_client_process, daemon=True,
            args=(url, prompts, clients, requests, max_tokens, self._control, self._results),
        )
        self._process.start()
        if self._results.get(timeout=300) != "ready":
            raise RuntimeError("the client process did not start")

    def run(self) -> tuple[float, list[tuple[float, float, int]]]:
        """(wall seconds, [(ttft, latency, text chunks)] per request)."""
        self._control.put("go")
        outcome: tuple[float, list[tuple[float, float, int]]] = self._results.get(timeout=600)
        return outcome

    def close(self) -> None:
        self._control.put("stop")
        self._process.join(30)
