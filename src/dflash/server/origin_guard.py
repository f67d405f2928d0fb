"""Browser guard: what a web page must not be able to do to a server that has no API key by default.

A page on any site can send requests to `http://127.0.0.1:8000` from the visitor's browser. Three checks
stop it, before any route runs:

- `Host`: a page that rebinds its own DNS name to 127.0.0.1 (DNS rebinding) talks to this server as
  `evil.example:8000`, same-origin from the browser's point of view, and may read the answers. Only the
  names this server is reached by are accepted (loopback names and the listening address, plus
  `--allowed-hosts`).
- `Origin`: browsers name the page's origin on cross-site requests; non-browser clients send none. A foreign
  origin is refused unless `--allowed-origins` names it; a page served by this server itself is fine.
- `Content-Type`: a "simple" cross-site POST (`text/plain`, form data) reaches the server without a CORS
  preflight; API bodies must be declared JSON (`application/json` or `application/*+json`).

Pure ASGI, so the answers and streams of accepted requests pass through untouched. `/health` stays open.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Receive, Scope, Send

from dflash.server.errors import APIError, error_response

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
WILDCARD_ADDRESSES = frozenset({"0.0.0.0", "::", ""})
_OPEN_PATHS = frozenset({"/health"})
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
_DEFAULT_PORTS = {"http": 80, "https": 443, "ws": 80, "wss": 443}


def is_loopback(host: str) -> bool:
    name = host.strip("[]").lower()
    if name in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class BrowserPolicy:
    """Which `Host` and `Origin` values are accepted."""

    hosts: frozenset[str] | None  # host names without port, lower case; None: any
    origins: frozenset[str]  # "scheme://host[:port]", lower case; "*": any

    @classmethod
    def for_server(
        cls, listen_host: str, allowed_hosts: tuple[str, ...] | None, allowed_origins: tuple[str, ...]
    ) -> BrowserPolicy:
        """The policy of a server listening on `listen_host`.

        Without `allowed_hosts`, a loopback server accepts only loopback names; a server listening on another
        address accepts any Host, since the names it is reached by (its addresses, DNS names, proxies) are
        unknown here and it was exposed on purpose. Given `allowed_hosts` ("*": any), only loopback names, the
        listening address and those names are accepted.
        """
        origins = frozenset(normalize_origin(o) for o in allowed_origins)
        if allowed_hosts is None and not is_loopback(listen_host):
            return cls(None, origins)
        names = {host_name(h) for h in allowed_hosts or ()}
        if "*" in names:
            return cls(None, origins)
        names |= LOOPBACK_NAMES
        if listen_host.strip("[]") not in WILDCARD_ADDRESSES:
            names.add(host_name(listen_host))
        return cls(frozenset(names), origins)

    def host_allowed(self, host_header: str) -> bool:
        return self.hosts is None or host_name(host_header) in self.hosts

    def origin_allowed(self, origin: str, host_header: str, scheme: str) -> bool:
        """An `Origin` naming this server itself (as reached through `host_header`) or one allowed by flag."""
        normalized = normalize_origin(origin)
        if "*" in self.origins or normalized in self.origins:
            return True
        try:
            parts = urlsplit(normalized)
            origin_port = parts.port or _DEFAULT_PORTS.get(parts.scheme)
        except ValueError:  # "null" (sandboxed pages, files) or garbage: never our own origin
            return False
        if not parts.hostname or not host_header:
            return False
        own_name, own_port = split_host(host_header)
        return (parts.hostname, origin_port) == (own_name, own_port or _DEFAULT_PORTS.get(scheme))


def normalize_origin(origin: str) -> str:
    return origin.strip().rstrip("/").lower()


def split_host(value: str) -> tuple[str, int | None]:
    """(name, port) of a `Host` header: `name`, `name:port`, `[v6]` or `[v6]:port`; name lower case without
    brackets or a trailing dot."""
    value = value.strip().lower()
    port_text = ""
    if value.startswith("["):
        name, _, rest = value[1:].partition("]")
        port_text = rest[1:] if rest.startswith(":") else ""
    elif value.count(":") == 1:
        name, _, port_text = value.partition(":")
    else:
        name = value
    port = int(port_text) if port_text.isdigit() else None
    return name.rstrip("."), port


def host_name(value: str) -> str:
    return split_host(value)[0] if value.strip() != "*" else "*"


def is_json_media_type(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    kind, _, subtype = media.partition("/")
    return kind == "application" and (subtype == "json" or subtype.endswith("+json"))


class BrowserGuard:
    """Refuses foreign `Host` and `Origin` headers (403) and non-JSON API bodies (415), in the API's error format."""

    def __init__(self, app: ASGIApp, policy: BrowserPolicy) -> None:
        self.app, self.policy = app, policy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = str(scope.get("path", ""))
        if scope["type"] != "http" or path in _OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        err = self._refusal(scope, path)
        if err is None:
            await self.app(scope, receive, send)
            return
        await error_response(path, err)(scope, receive, send)

    def _refusal(self, scope: Scope, path: str) -> APIError | None:
        headers = {name.lower(): value.decode("latin-1") for name, value in scope.get("headers", [])}
        host = headers.get(b"host")
        if host is not None and not self.policy.host_allowed(host):
            return APIError(
                403, f"Host {host!r} is not a name of this server (a web page may be rebinding its DNS name to it); "
                f"start the server with --allowed-hosts {host_name(host) or '<name>'} to accept it",
                kind="permission", code="host_not_allowed",
            )
        origin = headers.get(b"origin")
        if origin is not None and not self.policy.origin_allowed(origin, host or "", str(scope.get("scheme", "http"))):
            return APIError(
                403, f"cross-origin request from {origin!r} refused; start the server with --allowed-origins "
                f"{normalize_origin(origin)} to let that web page use it", kind="permission", code="origin_not_allowed",
            )
        method = str(scope.get("method", "")).upper()
        if method in _BODY_METHODS and path.startswith("/v1/"):
            content_type = headers.get(b"content-type", "")
            if not is_json_media_type(content_type):
                shown = repr(content_type) if content_type else "none"
                return APIError(
                    415, f"the request body must be JSON: send 'Content-Type: application/json' (got {shown})",
                    code="unsupported_media_type",
                )
        return None
