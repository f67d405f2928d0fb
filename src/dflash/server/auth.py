"""API-key check (`--api-key`): `Authorization: Bearer KEY` or `x-api-key: KEY` on every `/v1/` route.

`/health` and `/metrics` stay open (probes and scrapers); a missing or wrong key is a 401 in the error
format of the API that was called.
"""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from dflash.server.errors import APIError, error_response


def presented_keys(headers: list[tuple[bytes, bytes]]) -> list[str]:
    keys = []
    for name, value in headers:
        lower = name.lower()
        text = value.decode("latin-1").strip()
        if lower == b"authorization" and text[:7].lower() == "bearer ":
            keys.append(text[7:].strip())
        elif lower == b"x-api-key":
            keys.append(text)
    return keys


class APIKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.api_key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not str(scope.get("path", "")).startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        keys = presented_keys(list(scope.get("headers", [])))
        if any(hmac.compare_digest(k.encode(), self.api_key) for k in keys):
            await self.app(scope, receive, send)
            return
        message = "invalid API key" if keys else (
            "missing API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'"
        )
        err = APIError(401, message, kind="authentication", code="invalid_api_key")
        response = error_response(str(scope["path"]), err)
        await response(scope, receive, send)
