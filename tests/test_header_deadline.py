"""Connections that never finish sending their request headers are answered 408 and closed (`header_deadline`),
while ordinary requests, slow-but-complete ones and keep-alive reuse are untouched."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator

import httpx
import pytest

from dflash.server import ServerSettings, create_app
from dflash.server.header_deadline import header_deadline_protocol
from tests.server_helpers import FakeEngine, ServerThread

pytestmark = pytest.mark.timeout(60)

DEADLINE_S = 0.6


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    running = ServerThread(create_app(FakeEngine(), ServerSettings()), http=header_deadline_protocol(DEADLINE_S),
                           timeout_keep_alive=5).start()
    try:
        yield running
    finally:
        running.stop()


def connect(server: ServerThread) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    return sock


def read_all(sock: socket.socket) -> bytes:
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def test_stalled_headers_get_408_and_the_connection_closes(server: ServerThread) -> None:
    sock = connect(server)
    started = time.monotonic()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n")  # and nothing more
    answer = read_all(sock)  # returns once the server closes the connection
    waited = time.monotonic() - started
    assert answer.startswith(b"HTTP/1.1 408 ")
    body = json.loads(answer.split(b"\r\n\r\n", 1)[1])
    assert body["error"]["code"] == "request_timeout"
    assert DEADLINE_S * 0.8 <= waited < DEADLINE_S + 5


def test_headers_dribbled_past_the_deadline_are_cut_off(server: ServerThread) -> None:
    sock = connect(server)
    started = time.monotonic()
    head = b"GET /health HTTP/1.1\r\nhost: 127.0.0.1\r\nx-slow: " + b"a" * 40
    try:
        for byte in head:  # one byte every 50 ms: the headers would take 3 s
            sock.sendall(bytes([byte]))
            time.sleep(0.05)
    except OSError:
        pass  # the server closed the connection while we were still sending
    answer = read_all(sock)
    assert answer.startswith(b"HTTP/1.1 408 ") or answer == b""
    assert time.monotonic() - started < DEADLINE_S + 5


def test_a_connection_that_sends_nothing_is_closed(server: ServerThread) -> None:
    sock = connect(server)
    assert read_all(sock).startswith(b"HTTP/1.1 408 ")


def test_complete_requests_and_keep_alive_reuse_are_untouched(server: ServerThread) -> None:
    with httpx.Client(base_url=server.url, timeout=10) as client:
        for _ in range(3):
            body = {"model": "any", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
            assert client.post("/v1/chat/completions", json=body).status_code == 200
            time.sleep(DEADLINE_S * 1.5)  # idle between requests on the same connection: keep-alive's business
        assert client.get("/health").status_code == 200
    sock = connect(server)
    sock.sendall(b"GET /health HTTP/1.1\r\nhost: 127.0.0.1\r\n")
    time.sleep(DEADLINE_S / 3)
    sock.sendall(b"connection: close\r\n\r\n")  # headers complete in two parts, within the deadline
    assert read_all(sock).startswith(b"HTTP/1.1 200 ")


def test_connections_on_a_handed_over_socket_send_without_nagle() -> None:
    """asyncio leaves Nagle's algorithm on for a listening socket made without proto=IPPROTO_TCP (the tests' and
    any socket handed to uvicorn): the protocol turns it off itself, so streamed tokens are not held back."""
    from dflash.server.header_deadline import _send_without_delay

    class Transport:
        def __init__(self, sock: socket.socket) -> None:
            self.sock = sock

        def get_extra_info(self, name: str) -> object:
            return self.sock if name == "socket" else None

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        with socket.create_connection(listener.getsockname()):
            accepted, _ = listener.accept()
            with accepted:
                assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 0
                _send_without_delay(Transport(accepted))  # type: ignore[arg-type]
                assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
