"""`dflash serve`: OpenAI-, Anthropic- and Responses-compatible HTTP server for one model.

Agent stall recovery is opt-in through the environment: DFLASH_MIN_TOKENS=N, DFLASH_STALL_TOOL_PREFIX=1,
DFLASH_DEGENERATE_RUN_TOKENS=N (see dflash.server.stall).

API key: none by default. Give one through $DFLASH_API_KEY or --api-key-file PATH (--api-key KEY also works,
but other users of the machine can read it in `ps`); the start-up banner names it without printing it.

Web pages: the API refuses request bodies not declared JSON (415), cross-site requests (a foreign Origin
header, 403) unless --allowed-origins names the site, and, on a loopback address, Host names other than
localhost, 127.0.0.1 and [::1] (DNS rebinding, 403) unless --allowed-hosts names them. With a non-loopback
--host every Host name is accepted (the names the server is reached by are unknown), unless --allowed-hosts
is given.

Concurrency: --max-concurrency requests generate at once (decoded together in one batched step) and up to
--max-queue more wait for a free slot; past that a request is refused at once, 429 on the OpenAI APIs and
529 `overloaded_error` on the Anthropic one, with a Retry-After header the official SDKs honour.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from dflash.cli.api_key import ENV_VAR, APIKey, load_api_key
from dflash.cli.common import (
    add_model_options,
    add_prefix_cache_option,
    engine_from_args,
    max_batch_from_args,
)
from dflash.cli.ranks import add_tensor_parallel_option, run_ranks, tensor_parallel_size
from dflash.errors import DFlashError

DEFAULT_MAX_QUEUE = 64  # ServerSettings' default too (kept here: the HTTP extras load only when serving)


def register(commands: Any) -> None:
    parser = commands.add_parser(
        "serve", help="serve the model over HTTP (OpenAI, Anthropic and Responses APIs)", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_options(parser)
    add_prefix_cache_option(parser)
    add_tensor_parallel_option(parser)
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    group.add_argument("--port", type=int, default=8000)
    group.add_argument("--served-model-name", default=None, help="model id clients use (default: the model's name)")
    group.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer KEY' or 'x-api-key: KEY' on /v1/ routes (visible in "
                       f"`ps`: prefer ${ENV_VAR} or --api-key-file)")
    group.add_argument("--api-key-file", default=None, metavar="PATH",
                       help=f"read the API key from this file (its only line); default: ${ENV_VAR} if set")
    group.add_argument("--allowed-hosts", default=None, metavar="A,B",
                       help="Host names accepted besides localhost/127.0.0.1/[::1] and the --host address ('*': any); "
                       "default: only those on a loopback --host, any on another --host")
    group.add_argument("--allowed-origins", default=None, metavar="A,B",
                       help="web origins (e.g. http://localhost:3000) whose pages may call the API, with CORS "
                       "('*': any); default: none but the server's own")
    group.add_argument("--chat-template-file", default=None, help="Jinja chat template replacing the model's")
    group.add_argument("--default-max-tokens", type=int, default=None,
                       help="completion budget of requests that name none (default 4096, capped by the context)")
    group.add_argument("--clamp-max-tokens", action="store_true",
                       help="cap a max tokens that does not fit the context to the room left (default: 400 error); "
                       "agents such as Claude Code ask for 32k")
    group.add_argument("--remap-developer-role", action="store_true",
                       help="render OpenAI 'developer' messages as 'system' (for templates that reject it)")
    group.add_argument("--max-body-mb", type=float, default=8.0, help="request body limit in MiB (larger: 413)")
    group.add_argument("--body-timeout", type=float, default=60.0, metavar="SECONDS",
                       help="time to receive a request's headers, and then its whole body (slower or stalled "
                       "senders: 408)")
    group.add_argument("--keep-alive-timeout", type=float, default=30.0, metavar="SECONDS",
                       help="close a client's idle connection after this")
    group.add_argument("--max-queue", type=int, default=DEFAULT_MAX_QUEUE, metavar="N",
                       help="requests waiting for a generation slot beyond the --max-concurrency running ones; "
                       f"more are refused with 429 (OpenAI APIs) or 529 (Anthropic) and Retry-After (default "
                       f"{DEFAULT_MAX_QUEUE})")
    group.add_argument("--request-timeout", type=float, default=None, metavar="SECONDS",
                       help="stop a generation this long after its request arrived (queue time included): the "
                       "client gets the text so far with finish reason 'length' (Anthropic: stop reason "
                       "'max_tokens'), as when the token budget runs out (default: no limit)")
    parser.set_defaults(run=run)


def settings_from_args(args: argparse.Namespace, key: APIKey | None = None) -> Any:
    """Settings of the flags; the API key is `key` if given, else loaded from the flags and environment."""
    from dflash.server.settings import ServerSettings
    from dflash.server.stall import StallSettings

    template = None
    if args.chat_template_file:
        path = Path(args.chat_template_file).expanduser()
        try:
            template = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise DFlashError(f"--chat-template-file {path}: {exc.strerror or exc}") from None
    if args.default_max_tokens is not None and args.default_max_tokens < 1:
        raise DFlashError(f"--default-max-tokens must be at least 1, got {args.default_max_tokens}")
    if not 0 < args.port < 65536:
        raise DFlashError(f"--port must be in 1..65535, got {args.port}")
    timeouts = [("--body-timeout", args.body_timeout), ("--keep-alive-timeout", args.keep_alive_timeout)]
    if args.request_timeout is not None:
        timeouts.append(("--request-timeout", args.request_timeout))
    for flag, seconds in timeouts:
        if not seconds > 0:
            raise DFlashError(f"{flag} must be a positive number of seconds, got {seconds}")
    if args.max_queue < 0:
        raise DFlashError(f"--max-queue must not be negative, got {args.max_queue}")
    key = key or load_api_key(args.api_key, args.api_key_file, os.environ)
    return ServerSettings(
        host=args.host, port=args.port, served_model_name=args.served_model_name,
        api_key=key.value if key else None, allowed_hosts=_host_list(args.allowed_hosts),
        allowed_origins=_origin_list(args.allowed_origins), body_timeout_s=args.body_timeout,
        http_keep_alive_s=args.keep_alive_timeout,
        default_max_tokens=args.default_max_tokens, clamp_max_tokens=args.clamp_max_tokens,
        remap_developer_role=args.remap_developer_role,
        chat_template=template, max_body_bytes=int(args.max_body_mb * 1024 * 1024), stall=StallSettings.from_env(),
        max_concurrency=max_batch_from_args(args), max_queue=args.max_queue, request_timeout_s=args.request_timeout,
    )


def _host_list(text: str | None) -> tuple[str, ...] | None:
    if text is None:
        return None
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    for name in names:
        if "/" in name or " " in name:
            raise DFlashError(f"--allowed-hosts: {name!r} is not a host name (give names like gpu-box.lan, or '*')")
    if not names:
        raise DFlashError("--allowed-hosts is empty (give names like gpu-box.lan, or '*')")
    return names


def _origin_list(text: str | None) -> tuple[str, ...]:
    origins = tuple(o.strip().rstrip("/") for o in (text or "").split(",") if o.strip())
    for origin in origins:
        parts = urlsplit(origin)
        if origin != "*" and (parts.scheme not in ("http", "https") or not parts.netloc or parts.path):
            raise DFlashError(f"--allowed-origins: {origin!r} is not a web origin like http://localhost:3000 (or '*')")
    return origins


def banner(settings: Any, model: str, spec: str, key: APIKey | None = None, concurrency: int | None = None) -> str:
    """How to connect, for the log; the API key is named by where it comes from (`key`), never printed."""
    host = "127.0.0.1" if settings.host in ("0.0.0.0", "::", "") else settings.host
    netloc = f"[{host}]:{settings.port}" if ":" in host else f"{host}:{settings.port}"
    url = f"http://{netloc}"
    if settings.api_key and key is None:
        key = APIKey(settings.api_key, '"<your key>"', "<your key>", "settings")
    py_key, sh_key = (key.python, key.shell) if key else ('"dummy"', "dummy")
    codex_key = f' env_key="{ENV_VAR}"' if key else ""
    codex_env = f" (run it as {ENV_VAR}=\"{key.shell}\" codex)" if key and key.shell != f"${ENV_VAR}" else ""
    curl_key = f' -H "Authorization: Bearer {sh_key}"' if key else ""
    lines = [
        f"dflash serve: {model} ({spec} decoding) listening on http://{settings.host}:{settings.port}",
        f"  OpenAI SDK:   OpenAI(base_url=\"{url}/v1\", api_key={py_key}), model=\"{model}\" (or \"any\")",
        f"  Anthropic:    Anthropic(base_url=\"{url}\", api_key={py_key})",
        f"  Claude Code:  ANTHROPIC_BASE_URL={url} ANTHROPIC_AUTH_TOKEN=\"{sh_key}\" ANTHROPIC_MODEL={model} "
        f"ANTHROPIC_DEFAULT_HAIKU_MODEL={model} CLAUDE_CODE_MAX_OUTPUT_TOKENS=<fits the context> claude",
        f"  Codex:        [model_providers.dflash] base_url=\"{url}/v1\" wire_api=\"responses\"{codex_key}; "
        f"model=\"{model}\"{codex_env}",
        f"  curl:         curl {url}/v1/chat/completions -H 'Content-Type: application/json'{curl_key} "
        "-d '{\"model\":\"any\",\"messages\":[{\"role\":\"user\",\"content\":\"Hello\"}]}'",
        f"  health {url}/health   metrics {url}/metrics",
    ]
    if concurrency is not None:
        waiting = "unbounded" if settings.max_queue is None else f"up to {settings.max_queue}"
        lines.append(f"  {concurrency} request{'s' if concurrency != 1 else ''} decoding at once "
                     f"(--max-concurrency), {waiting} waiting (--max-queue)")
    if key is not None:
        exposed = " (other users can read it in `ps`: prefer $DFLASH_API_KEY or --api-key-file)" \
            if key.source == "--api-key" else ""
        lines.append(f"  API key required on /v1/, from {key.source}{exposed}")
    stall = settings.stall.describe()
    if stall:
        lines.append(f"  stall recovery on: {', '.join(stall)}")
    if not settings.api_key and host != settings.host:
        lines.append("  warning: listening on every interface without an API key")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    _http_stack()  # a missing HTTP extra is reported before the model loads
    key = load_api_key(args.api_key, args.api_key_file, os.environ)
    settings = settings_from_args(args, key)
    print("loading model...", file=sys.stderr, flush=True)
    if tensor_parallel_size(args) > 1:  # the first rank serves, the others follow it (`dflash.cli.ranks`)
        return run_ranks(args, serve_with)
    return _serve(engine_from_args(args), args, settings, key)


def serve_with(engine: Any, args: argparse.Namespace) -> int:
    """Serve `engine` (the first rank's, under --tensor-parallel) as the flags say."""
    key = load_api_key(args.api_key, args.api_key_file, os.environ)
    return _serve(engine, args, settings_from_args(args, key), key)


def _http_stack() -> tuple[Any, Any, Any]:
    """uvicorn.run, the app factory and the header-deadline protocol (a DFlashError names a missing extra)."""
    try:
        import uvicorn

        from dflash.server import create_app
        from dflash.server.header_deadline import header_deadline_protocol
    except ImportError as exc:
        raise DFlashError(
            f"dflash serve needs the HTTP extras ({exc.name} is missing): pip install 'dflash-server[server]'"
        ) from None
    return uvicorn.run, create_app, header_deadline_protocol


def _serve(engine: Any, args: argparse.Namespace, settings: Any, key: APIKey | None) -> int:
    run_server, create_app, header_deadline_protocol = _http_stack()
    print("warming up (first start on a machine: kernels are compiled, a minute or more)...", file=sys.stderr,
          flush=True)
    started = time.monotonic()
    engine.warm_up()  # CUDA graphs of the first shapes captured, CPU kernels built, before the first request
    print(f"warm in {time.monotonic() - started:.1f} s", file=sys.stderr, flush=True)
    app = create_app(engine, settings)
    print(banner(settings, settings.served_model_name or engine.model_name, engine.options.spec, key,
                 concurrency=settings.concurrency_for(engine.options)),
          file=sys.stderr, flush=True)
    run_server(app, host=settings.host, port=settings.port, log_level="info" if args.verbose else "warning",
               timeout_graceful_shutdown=5, timeout_keep_alive=settings.http_keep_alive_s,
               http=header_deadline_protocol(settings.body_timeout_s))
    return 0
