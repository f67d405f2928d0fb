"""Closing a connection without losing the answer: half-close, drain what the client still sends, then close.

When the server answers before it has read the whole request (a 408 for a body that is too slow, a request
refused early) and closes the socket while the client's bytes are still arriving or unread, the kernel answers
them with a reset, and a reset makes the client's kernel discard the answer it has not read yet: the client sees
"connection reset" instead of the 408. Web servers avoid this with a lingering close: send the answer and a FIN
(`write_eof`), keep reading and discarding the client's bytes for a moment, then close. `LingeringTransport` wraps
an asyncio transport so that `close()` does that; the protocol drops whatever arrives meanwhile
(`lingering`)."""

from __future__ import annotations

import asyncio
from typing import Any

__all__ = ["LINGER_S", "LingeringTransport"]

# How long a closing connection keeps draining the client's bytes before it closes for good.
LINGER_S = 1.0


class LingeringTransport:
    """An asyncio transport whose `close()` half-closes, drains for `linger_s`, then closes; everything else is
    the wrapped transport's."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop, linger_s: float = LINGER_S) -> None:
        self._transport = transport
        self._loop = loop
        self._linger_s = linger_s
        self._timer: asyncio.TimerHandle | None = None
        self.lingering = False

    def close(self) -> None:
        if self.lingering or self._transport.is_closing():
            return
        self.lingering = True
        if not self._transport.can_write_eof():
            self._transport.close()
            return
        self._transport.write_eof()  # after the buffered answer: the client reads it, then sees the end
        self._transport.resume_reading()  # drain even where flow control had paused reading
        self._timer = self._loop.call_later(self._linger_s, self._transport.close)

    def is_closing(self) -> bool:
        return self.lingering or self._transport.is_closing()

    def connection_lost(self) -> None:
        """The peer closed first (or the transport failed): nothing left to wait for."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)
