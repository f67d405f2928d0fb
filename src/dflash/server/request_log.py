"""`RequestCounter`: counts every HTTP answer by route, method and status, and logs one line per refused
request (4xx) with the error message the client was given.

Pure ASGI: streamed answers pass through untouched; only the (small JSON) body of a 4xx answer is looked at.
"""

from __future__ import annotations

import json
import logging

from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from dflash.server.metrics import Metrics

log = logging.getLogger("dflash.server")

_MESSAGE_CHARS = 300  # one concise line, even for a validation error that lists many fields
_BODY_BYTES = 16 * 1024  # error bodies are far smaller; anything beyond is not read for the log


class RequestCounter:
    def __init__(self, app: ASGIApp, metrics: Metrics, routes: list[BaseRoute]) -> None:
        self.app, self.metrics, self.routes = app, metrics, routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = [500]
        error_body = bytearray()

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = int(message["status"])
            elif message["type"] == "http.response.body" and 400 <= status[0] < 500:
                error_body.extend(bytes(message.get("body", b""))[: _BODY_BYTES - len(error_body)])
            await send(message)

        method, path, route = str(scope.get("method", "")), str(scope.get("path", "")), self._route(scope)
        try:
            await self.app(scope, receive, counting_send)
        finally:
            self.metrics.http_requests.labels(route, method, str(status[0])).inc()
            if 400 <= status[0] < 500:
                log.warning("%s %s -> %d: %s", method, one_line(path), status[0], error_message(bytes(error_body)))

    def _route(self, scope: Scope) -> str:
        for route in self.routes:
            match, _ = route.matches(dict(scope))
            if match == Match.FULL:
                return str(getattr(route, "path", "other"))
        return "other"


def error_message(body: bytes) -> str:
    """The `error.message` of an OpenAI or Anthropic error body, on one line and shortened; else the raw text."""
    text = body.decode("utf-8", "replace")
    try:
        data = json.loads(text)
        message = data["error"]["message"]
        if isinstance(message, str):
            text = message
    except (ValueError, KeyError, TypeError):
        pass
    text = one_line(text)
    return text if len(text) <= _MESSAGE_CHARS else text[: _MESSAGE_CHARS - 3] + "..."


def one_line(text: str) -> str:
    """`text` with whitespace runs as one space and other control characters escaped: a client cannot forge
    log lines or terminal escapes through a path or an echoed value."""
    text = " ".join(text.split())
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)
