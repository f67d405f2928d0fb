"""Errors in each API's own JSON format.

OpenAI (chat, completions, responses, models): `{"error": {"message", "type", "param", "code"}}`.
Anthropic (`/v1/messages...`): `{"type": "error", "error": {"type", "message"}}`.
The format is chosen by path, so an error raised anywhere (auth, body parsing, routing) reads right to the
client that sent the request.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("dflash.server")

ErrorKind = Literal[
    "invalid_request", "authentication", "permission", "not_found", "too_large", "server", "unavailable",
    "overloaded",
]

_OPENAI_TYPE: dict[ErrorKind, str] = {
    "invalid_request": "invalid_request_error",
    "authentication": "invalid_request_error",
    "permission": "invalid_request_error",
    "not_found": "invalid_request_error",
    "too_large": "invalid_request_error",
    "server": "server_error",
    "unavailable": "server_error",
    "overloaded": "server_error",  # what OpenAI sends with its 429 "currently overloaded" answers
}
_ANTHROPIC_TYPE: dict[ErrorKind, str] = {
    "invalid_request": "invalid_request_error",
    "authentication": "authentication_error",
    "permission": "permission_error",
    "not_found": "not_found_error",
    "too_large": "request_too_large",
    "server": "api_error",
    "unavailable": "overloaded_error",
    "overloaded": "overloaded_error",
}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        kind: ErrorKind = "invalid_request",
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        message, param = _printable(message), _printable(param) if param is not None else None
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code
        self.headers = dict(headers or {})  # sent with the error answer (e.g. Retry-After)


def _printable(text: str) -> str:
    """`text` as valid Unicode: an error that quotes a client's lone surrogate must still be writable as JSON."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def is_anthropic_path(path: str) -> bool:
    return path.startswith("/v1/messages")


def openai_error_body(err: APIError) -> dict[str, Any]:
    return {"error": {"message": err.message, "type": _OPENAI_TYPE[err.kind], "param": err.param, "code": err.code}}


def anthropic_error_body(err: APIError) -> dict[str, Any]:
    return {"type": "error", "error": {"type": _ANTHROPIC_TYPE[err.kind], "message": err.message}}


def error_body(path: str, err: APIError) -> dict[str, Any]:
    return anthropic_error_body(err) if is_anthropic_path(path) else openai_error_body(err)


def error_response(path: str, err: APIError) -> JSONResponse:
    return JSONResponse(error_body(path, err), status_code=err.status, headers=err.headers or None)


def overloaded(retry_after_s: int, detail: str, *, anthropic: bool) -> APIError:
    """The server's queue is full: 529 `overloaded_error` for Anthropic clients, 429 for OpenAI ones (the
    status both SDKs retry, honouring Retry-After)."""
    status = 529 if anthropic else 429
    message = f"the server is overloaded ({detail}); retry after {retry_after_s} s"
    return APIError(status, message, kind="overloaded", code="overloaded",
                    headers={"Retry-After": str(retry_after_s)})


def internal_error(exc: BaseException) -> APIError:
    """A computation failure, reported as such (500), never as a cancellation."""
    return APIError(500, f"generation failed: {type(exc).__name__}: {exc}", kind="server", code="internal_error")


def install_error_handlers(app: FastAPI) -> None:
    async def on_api_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, APIError)
        return error_response(request.url.path, exc)

    async def on_http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        kind: ErrorKind = "not_found" if exc.status_code == 404 else "invalid_request"
        message = f"no route {request.method} {request.url.path}" if exc.status_code in (404, 405) else str(exc.detail)
        err = APIError(exc.status_code, message, kind=kind)
        return error_response(request.url.path, err)

    async def on_validation_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return error_response(request.url.path, APIError(400, str(exc)))

    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
        err = APIError(500, f"internal server error: {type(exc).__name__}: {exc}", kind="server")
        return error_response(request.url.path, err)

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(Exception, on_unexpected)
