"""`dflash serve`: OpenAI-, Anthropic- and Responses-compatible HTTP server for one model.

Agent stall recovery is opt-in through the environment: DFLASH_MIN_TOKENS=N, DFLASH_STALL_TOOL_PREFIX=1,
DFLASH_DEGENERATE_RUN_TOKENS=N (see dflash.server.stall).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from dflash.cli.common import add_model_options, add_prefix_cache_option, engine_from_args
from dflash.errors import DFlashError


def register(commands: Any) -> None:
    parser = commands.add_parser(
        "serve", help="serve the model over HTTP (OpenAI, Anthropic and Responses APIs)", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_options(parser)
    add_prefix_cache_option(parser)
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    group.add_argument("--port", type=int, default=8000)
    group.add_argument("--served-model-name", default=None, help="model id clients use (default: the model's name)")
    group.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer KEY' or 'x-api-key: KEY' on /v1/ routes")
    group.add_argument("--chat-template-file", default=None, help="Jinja chat template replacing the model's")
    group.add_argument("--default-max-tokens", type=int, default=None,
                       help="completion budget of requests that name none (default 4096, capped by the context)")
    group.add_argument("--clamp-max-tokens", action="store_true",
                       help="cap a max tokens that does not fit the context to the room left (default: 400 error); "
                       "agents such as Claude Code ask for 32k")
    group.add_argument("--remap-developer-role", action="store_true",
                       help="render OpenAI 'developer' messages as 'system' (for templates that reject it)")
    group.add_argument("--max-body-mb", type=float, default=8.0, help="request body limit in MiB (larger: 413)")
    parser.set_defaults(run=run)


def settings_from_args(args: argparse.Namespace) -> Any:
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
    return ServerSettings(
        host=args.host, port=args.port, served_model_name=args.served_model_name, api_key=args.api_key,
        default_max_tokens=args.default_max_tokens, clamp_max_tokens=args.clamp_max_tokens,
        remap_developer_role=args.remap_developer_role,
        chat_template=template, max_body_bytes=int(args.max_body_mb * 1024 * 1024), stall=StallSettings.from_env(),
    )


def banner(settings: Any, model: str, spec: str) -> str:
    host = "127.0.0.1" if settings.host in ("0.0.0.0", "::", "") else settings.host
    url = f"http://{host}:{settings.port}"
    key = settings.api_key or "dummy"
    lines = [
        f"dflash serve: {model} ({spec} decoding) listening on http://{settings.host}:{settings.port}",
        f"  OpenAI SDK:   OpenAI(base_url=\"{url}/v1\", api_key=\"{key}\"), model=\"{model}\" (or \"any\")",
        f"  Anthropic:    Anthropic(base_url=\"{url}\", api_key=\"{key}\")",
        f"  Claude Code:  ANTHROPIC_BASE_URL={url} ANTHROPIC_AUTH_TOKEN={key} ANTHROPIC_MODEL={model} "
        f"ANTHROPIC_DEFAULT_HAIKU_MODEL={model} CLAUDE_CODE_MAX_OUTPUT_TOKENS=<fits the context> claude",
        f"  Codex:        [model_providers.dflash] base_url=\"{url}/v1\" wire_api=\"responses\"; model=\"{model}\"",
        f"  curl:         curl {url}/v1/chat/completions -H 'Content-Type: application/json' "
        "-d '{\"model\":\"any\",\"messages\":[{\"role\":\"user\",\"content\":\"Hello\"}]}'",
        f"  health {url}/health   metrics {url}/metrics",
    ]
    stall = settings.stall.describe()
    if stall:
        lines.append(f"  stall recovery on: {', '.join(stall)}")
    if not settings.api_key and host != settings.host:
        lines.append("  warning: listening on every interface without --api-key")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from dflash.server import create_app
    except ImportError as exc:
        raise DFlashError(
            f"dflash serve needs the HTTP extras ({exc.name} is missing): pip install 'dflash-server[server]'"
        ) from None
    settings = settings_from_args(args)
    print("loading model...", file=sys.stderr, flush=True)
    engine = engine_from_args(args)
    engine.warm_up()  # CUDA graphs of the first shapes are captured before the first request
    app = create_app(engine, settings)
    print(banner(settings, settings.served_model_name or engine.model_name, engine.options.spec), file=sys.stderr,
          flush=True)
    uvicorn.run(app, host=settings.host, port=settings.port, log_level="info" if args.verbose else "warning",
                timeout_graceful_shutdown=5)
    return 0
