"""`dflash connect claude|codex|opencode`: the client-side settings that point an agent at a dflash server.

Prints them (Claude Code: `export` lines to source; Codex: `config.toml` settings; OpenCode: `opencode.json`),
or with --write merges them into the client's config file, keeping what is already there. The model id and
context length are read from the running server's /v1/models unless --model and --context-length are given.
API keys are never printed: the settings name the environment variable that holds one (--api-key-env).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from dflash import environment
from dflash.cli import client_configs
from dflash.cli.client_configs import Target
from dflash.errors import DFlashError

CLIENTS = ("claude", "codex", "opencode")
DEFAULT_KEY_ENV = environment.API_KEY


def register(commands: Any) -> None:
    parser = commands.add_parser(
        "connect", help="print or write an agent client's settings for this server (Claude Code, Codex, OpenCode)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("client", choices=CLIENTS)
    parser.add_argument("--host", default="127.0.0.1", help="the server's address (as given to dflash serve)")
    parser.add_argument("--port", type=int, default=8000, help="the server's port (as given to dflash serve)")
    parser.add_argument("--url", default=None, help="the server's base URL, e.g. http://gpu-box:8000 (replaces --host/--port)")
    parser.add_argument("--model", default=None, help="model id (default: the one the server lists)")
    parser.add_argument("--context-length", type=int, default=None,
                        help="the model's context in tokens (default: the one the server lists)")
    parser.add_argument("--api-key-env", default=DEFAULT_KEY_ENV,
                        help=f"environment variable the client reads the server's API key from (default {DEFAULT_KEY_ENV})")
    parser.add_argument("--write", action="store_true",
                        help="merge the settings into the client's config file instead of printing them (codex, opencode)")
    parser.add_argument("--config", default=None,
                        help="config file for --write (default: $CODEX_HOME/config.toml or ~/.codex/config.toml; "
                        "$XDG_CONFIG_HOME/opencode/opencode.json or ~/.config/opencode/opencode.json)")
    parser.add_argument("--force", action="store_true", help="with --write, overwrite keys that hold other values")
    parser.set_defaults(run=run)


def base_url(args: argparse.Namespace) -> str:
    if args.url:
        url = args.url.strip().rstrip("/")
        if not url.startswith(("http://", "https://")):
            raise DFlashError(f"--url must start with http:// or https://, got {args.url!r}")
        return url.removesuffix("/v1")
    if not 0 < args.port < 65536:
        raise DFlashError(f"--port must be in 1..65535, got {args.port}")
    host = "127.0.0.1" if args.host in ("0.0.0.0", "::", "") else args.host  # a listening address, not a target
    host = f"[{host}]" if ":" in host else host
    return f"http://{host}:{args.port}"


def served_model(url: str, key_env: str) -> tuple[str, int]:
    """(id, context length) of the first model the server at `url` lists."""
    request = urllib.request.Request(f"{url}/v1/models")
    key = os.environ.get(key_env)
    if key:
        request.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            listing = json.load(response)
        model = listing["data"][0]
        return str(model["id"]), int(model["context_length"])
    except urllib.error.HTTPError as exc:
        hint = f" (set {key_env} to the server's --api-key)" if exc.code == 401 else ""
        reason = f"HTTP {exc.code}{hint}"
    except urllib.error.URLError as exc:
        reason = str(exc.reason)
    except OSError as exc:
        reason = str(exc)
    except (ValueError, KeyError, IndexError, TypeError):
        reason = "not a dflash model listing"
    raise DFlashError(f"could not read the model from {url}/v1/models: {reason}; start `dflash serve` first, "
                      "or give --model and --context-length")


def target_from_args(args: argparse.Namespace) -> Target:
    url = base_url(args)
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", args.api_key_env):
        raise DFlashError(f"--api-key-env must be a variable name, got {args.api_key_env!r}")
    model, context = args.model, args.context_length
    if model is None or context is None:
        listed_model, listed_context = served_model(url, args.api_key_env)
        model = model or listed_model
        context = context or listed_context
    if context < 2:
        raise DFlashError(f"--context-length must be at least 2, got {context}")
    return Target(base_url=url, model=model, context_length=context, key_env=args.api_key_env)


def run(args: argparse.Namespace) -> int:
    target = target_from_args(args)
    if not args.write:
        render = {"claude": client_configs.claude_exports, "codex": client_configs.codex_toml,
                  "opencode": client_configs.opencode_json}[args.client]
        sys.stdout.write(render(target))
        return 0
    if args.client == "claude":
        raise DFlashError("Claude Code takes these settings from the environment: "
                          "run `eval \"$(dflash connect claude)\"` in the shell that starts claude")
    if args.client == "codex":
        path = Path(args.config).expanduser() if args.config else client_configs.codex_config_path(os.environ)
        overwritten = client_configs.write_codex(path, target, force=args.force)
    else:
        path = Path(args.config).expanduser() if args.config else client_configs.opencode_config_path(os.environ)
        overwritten = client_configs.write_opencode(path, target, force=args.force)
    print(f"wrote the {client_configs.PROVIDER_ID} provider ({target.model} at {target.openai_url}) into {path}"
          + (f"; overwrote {', '.join(overwritten)}" if overwritten else ""))
    print(f"the client reads the API key from ${target.key_env} (any value when the server has no --api-key)")
    return 0
