"""`BodyDeadline`: a request's whole body must arrive within `body_timeout_s` (`--body-timeout`).

A client that sends its headers and then dribbles or stops sending the body would otherwise hold its
connection (and the route reading it) forever. Once the deadline passes, the next read of the body raises a
408 `APIError`, answered in the called API's own format by the app's error handlers, with `Connection: close`
so the half-sent request cannot keep the connection. After the body is complete, `receive` is passed through
without a deadline (streamed answers keep listening for the client's disconnect). Pure ASGI.
"""

from __future__ import annotations

import asyncio

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from dflash.server.errors import APIError


class BodyDeadline:
    def __init__(self, app: ASGIApp, timeout_s: float) -> None:
        self.app, self.timeout_s = app, timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        body_complete = False
        timed_out = False

        async def timed_receive() -> Message:
            nonlocal body_complete, timed_out
            if body_complete:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                timed_out = True
                raise APIError(
                    408, f"the request body was not received within {self.timeout_s:g} s", code="request_timeout"
                ) from None
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_complete = True
            return message

        async def closing_send(message: Message) -> None:
            if timed_out and message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close")]}
            await send(message)

        await self.app(scope, timed_receive, closing_send)
