"""Per-request opt-out of the prefix cache, the same way in every API.

A request skips the prefix cache (its prompt is neither read from nor stored in it) when its body has
`"cache_prompt": false` (the field llama.cpp's server uses) or when it carries the header
`X-DFlash-Prefix-Cache: off` (for clients that cannot add body fields, such as agents configured by environment).
"""

from __future__ import annotations

from starlette.requests import Request

from dflash.server.errors import APIError

PREFIX_CACHE_HEADER = "x-dflash-prefix-cache"
_OFF = frozenset({"off", "0", "false", "no"})
_ON = frozenset({"on", "1", "true", "yes"})


def prefix_cache_wanted(request: Request, cache_prompt: bool | None) -> bool:
    """False when the body field or the header opts out; a header value that is neither on nor off is a 400."""
    header = request.headers.get(PREFIX_CACHE_HEADER)
    if header is not None:
        value = header.strip().lower()
        if value not in _OFF | _ON:
            raise APIError(400, f"header {PREFIX_CACHE_HEADER}: expected 'on' or 'off', got {header!r}")
        if value in _OFF:
            return False
    return cache_prompt is not False
