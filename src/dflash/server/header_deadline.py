"""A deadline for request headers: connections that open and never finish sending their headers are closed.

uvicorn times out idle keep-alive connections, and the body deadline (`body_deadline.py`) bounds the time to send a
body, but nothing bounds the time from opening a connection (or starting the next request on it) to the end of
the request's headers: a client that sends `POST /v1/messages HTTP/1.1\\r\\n` and then a byte a minute holds a
connection open for good. This protocol, uvicorn's own h11 protocol plus one timer, answers such a client with a
408 and closes the connection once `timeout_s` has passed without complete headers. Its connections close
lingering (`dflash.server.lingering_close`), so an answer sent before the whole request was read reaches the client.

Its connections also send without Nagle's algorithm (TCP_NODELAY). asyncio sets that option itself only where the
listening socket was made with `proto=IPPROTO_TCP`: it is when uvicorn binds a host and port (`dflash serve`), not
for a socket bound beforehand and handed over (`sockets=`, a file descriptor). There a stream's small writes
waited for the client's delayed ACK of the previous one, up to about 40 ms on Linux: a stream's first tokens
arrived together that late and later ones in bursts.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from dflash.server.lingering_close import LingeringTransport

_BODY = json.dumps({"error": {
    "message": "the request headers were not received in time", "type": "invalid_request_error", "param": None,
    "code": "request_timeout",
}}).encode()
_RESPONSE = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
    b"content-length: " + str(len(_BODY)).encode() + b"\r\n\r\n" + _BODY
)


def header_deadline_protocol(timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol class with a `timeout_s` deadline on every request's headers (for `uvicorn.run(http=)`)."""

    class HeaderDeadlineProtocol(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            _send_without_delay(transport)
            self._lingering = LingeringTransport(transport, asyncio.get_running_loop())
            super().connection_made(self._lingering)  # type: ignore[arg-type]
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self._lingering.lingering:  # answered and closing: the rest of the request is dropped
                return
            super().data_received(data)
            if self.conn.their_state is h11.IDLE:  # some bytes of the next request's headers, not all of them
                if self._deadline is None:
                    self._arm()
            else:
                self._disarm()

        def on_response_complete(self) -> None:
            self._disarm()  # the connection is idle now: uvicorn's keep-alive timeout takes over
            super().on_response_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            self._lingering.connection_lost()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._deadline = self.loop.call_later(timeout_s, self._expired)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expired(self) -> None:
            self._deadline = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.write(_RESPONSE)
                self.transport.close()

    return HeaderDeadlineProtocol


def _send_without_delay(transport: asyncio.BaseTransport) -> None:
    """TCP_NODELAY on a TCP connection's socket (streamed tokens leave at once, not behind an unacknowledged write)."""
    sock = transport.get_extra_info("socket")
    if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
        return
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
