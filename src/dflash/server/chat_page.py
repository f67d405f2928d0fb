"""`GET /`: the built-in chat page, and `GET /static/{name}` for its script and style sheet.

The page is plain HTML/JS/CSS shipped as package data (`dflash/server/static/`), with no build step and no
resource from another origin. It talks only to this server's own `/v1/` API, so a strict
Content-Security-Policy (same-origin scripts, styles and fetches; no inline code; no framing) holds.
"""

from __future__ import annotations

from functools import cache
from importlib import resources

from fastapi import APIRouter
from fastapi.responses import Response

from dflash.server.errors import APIError

router = APIRouter()

CONTENT_SECURITY_POLICY = "; ".join([
    "default-src 'none'",
    "script-src 'self'",
    "style-src 'self'",
    "connect-src 'self'",
    "img-src 'self' data:",  # data: for the empty favicon, which spares a 404 on every load
    "base-uri 'none'",
    "form-action 'none'",
    "frame-ancestors 'none'",
])

# Only these files are served: the name in the URL is a key of this table, never a path on disk.
STATIC_TYPES = {
    "chat.js": "text/javascript; charset=utf-8",
    "chat.css": "text/css; charset=utf-8",
}


@cache
def static_file(name: str) -> bytes:
    return resources.files("dflash.server").joinpath("static").joinpath(name).read_bytes()


def page_headers() -> dict[str, str]:
    return {
        "Content-Security-Policy": CONTENT_SECURITY_POLICY,
        "X-Content-Type-Options": "nosniff",
        "Referrer-Policy": "no-referrer",
        "Cache-Control": "no-cache",  # a server upgrade shows the new page without a stale script
    }


@router.get("/", include_in_schema=False)
async def chat_page() -> Response:
    return Response(static_file("chat.html"), media_type="text/html; charset=utf-8", headers=page_headers())


@router.get("/static/{name}", include_in_schema=False)
async def chat_static(name: str) -> Response:
    media_type = STATIC_TYPES.get(name)
    if media_type is None:
        raise APIError(404, f"no static file {name!r}", kind="not_found")
    return Response(static_file(name), media_type=media_type, headers=page_headers())
