"""Server-sent events: framing helpers and a response that stops the generation when the client leaves.

`EventStreamResponse` listens for `http.disconnect` while it streams, whatever ASGI spec version the server
speaks, cancels the body iterator and calls `on_close` (which cancels the generation) when the client goes
away or the stream ends for any other reason.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncGenerator, Callable
from typing import Any

import anyio
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

log = logging.getLogger("dflash.server")

KEEPALIVE = ": keep-alive\n\n"


def data_event(payload: Any) -> str:
    """`data: <json>` (OpenAI chat / completions framing)."""
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def named_event(name: str, payload: Any) -> str:
    """`event: <name>` + `data: <json>` (Anthropic and Responses framing)."""
    return f"event: {name}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"


DONE = "data: [DONE]\n\n"


class EventStreamResponse(Response):
    media_type = "text/event-stream"

    def __init__(self, body: AsyncGenerator[str, None], *, on_close: Callable[[], None] | None = None) -> None:
        # Response.__init__ is skipped on purpose: it would declare a Content-Length for an empty body.
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.body_iterator = body
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:

                async def stream() -> None:
                    try:
                        await send({"type": "http.response.start", "status": self.status_code,
                                    "headers": self.raw_headers})
                        async for chunk in self.body_iterator:
                            await send({"type": "http.response.body", "body": chunk.encode("utf-8"), "more_body": True})
                        await send({"type": "http.response.body", "body": b"", "more_body": False})
                    except OSError:  # the connection broke under a send
                        log.info("stream connection lost")
                    finally:
                        group.cancel_scope.cancel()

                async def watch() -> None:
                    while True:
                        message = await receive()
                        if message["type"] == "http.disconnect":
                            log.info("client disconnected from a stream")
                            group.cancel_scope.cancel()
                            return

                group.start_soon(stream)
                group.start_soon(watch)
        finally:
            if self.on_close is not None:
                self.on_close()
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()
