"""What each agent client needs to talk to a dflash server, and merging that into the client's own config file.

Claude Code reads environment variables; Codex reads `config.toml` (a `[model_providers.dflash]` table plus the
top-level `model` / `model_provider`); OpenCode reads `opencode.json` (a `provider.dflash` entry built on
`@ai-sdk/openai-compatible`). No function here ever sees an API key's value: every config refers to the
environment variable that holds it.

Merging keeps everything already in the file: keys this server's config does not set are left as they are,
and a key it sets that already holds another value is a conflict, refused unless the caller forces it.
"""

from __future__ import annotations

import json
import os
import shlex
import tempfile
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomlkit

from dflash.errors import DFlashError

PROVIDER_ID = "dflash"  # the provider's key in Codex's and OpenCode's configs
PROVIDER_NAME = "dflash-server"


@dataclass(frozen=True)
class Target:
    """The server a client is pointed at."""

    base_url: str  # scheme://host:port, without /v1
    model: str  # the model id the server answers to
    context_length: int  # prompt + output tokens the model holds
    key_env: str  # environment variable holding the server's API key (any value when it has none)

    @property
    def openai_url(self) -> str:
        return f"{self.base_url}/v1"

    @property
    def output_budget(self) -> int:
        """Output tokens to ask for by default: a quarter of the context, so a prompt keeps the rest.

        Agents otherwise ask for 32k output tokens, which no small context holds."""
        return max(1, self.context_length // 4)


# ------------------------------------------------------------------------------------------------ Claude Code
def claude_env(target: Target) -> dict[str, str]:
    """Claude Code's environment; the token is a shell expression reading `target.key_env`."""
    return {
        "ANTHROPIC_BASE_URL": target.base_url,
        # Any value passes a server started without --api-key; the variable is read when the shell runs this.
        "ANTHROPIC_AUTH_TOKEN": f"${{{target.key_env}:-none}}",
        "ANTHROPIC_MODEL": target.model,
        # Background tasks (titles, summaries) go to the "small fast" model: the same one here. The first name
        # is the current one, the second the one older releases read.
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": target.model,
        "ANTHROPIC_SMALL_FAST_MODEL": target.model,
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(target.output_budget),
        # An id Claude Code does not know is assumed to hold a million tokens; this gives the real window.
        "CLAUDE_CODE_MAX_CONTEXT_TOKENS": str(target.context_length),
        # Telemetry, error reports and update checks would go to the vendor, not to this server.
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    }


def claude_exports(target: Target) -> str:
    """`export` lines a POSIX shell can source."""
    lines = [f"# Claude Code -> {PROVIDER_NAME} at {target.base_url} ({target.model}, "
             f"{target.context_length}-token context); the API key is read from ${target.key_env}"]
    for name, value in claude_env(target).items():
        quoted = f'"{value}"' if name == "ANTHROPIC_AUTH_TOKEN" else shlex.quote(value)
        lines.append(f"export {name}={quoted}")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------ Codex
def codex_settings(target: Target) -> dict[str, Any]:
    return {
        "model": target.model,
        "model_provider": PROVIDER_ID,
        "model_context_window": target.context_length,
        "model_providers": {
            PROVIDER_ID: {
                "name": PROVIDER_NAME,
                "base_url": target.openai_url,
                "wire_api": "responses",
                "env_key": target.key_env,
            },
        },
    }


def codex_toml(target: Target) -> str:
    return tomlkit.dumps(codex_settings(target))


def codex_config_path(environ: Mapping[str, str]) -> Path:
    home = environ.get("CODEX_HOME")
    return Path(home).expanduser() / "config.toml" if home else Path.home() / ".codex" / "config.toml"


# ------------------------------------------------------------------------------------------------ OpenCode
def opencode_settings(target: Target) -> dict[str, Any]:
    return {
        "$schema": "https://opencode.ai/config.json",
        "provider": {
            PROVIDER_ID: {
                "npm": "@ai-sdk/openai-compatible",
                "name": PROVIDER_NAME,
                "options": {"baseURL": target.openai_url, "apiKey": f"{{env:{target.key_env}}}"},
                "models": {
                    target.model: {
                        "name": target.model,
                        "limit": {"context": target.context_length, "output": target.output_budget},
                    },
                },
            },
        },
        "model": f"{PROVIDER_ID}/{target.model}",
    }


def opencode_json(target: Target) -> str:
    return json.dumps(opencode_settings(target), indent=2) + "\n"


def opencode_config_path(environ: Mapping[str, str]) -> Path:
    base = environ.get("XDG_CONFIG_HOME")
    return (Path(base).expanduser() if base else Path.home() / ".config") / "opencode" / "opencode.json"


# ------------------------------------------------------------------------------------------------ merging
def merge(existing: MutableMapping[str, Any], wanted: Mapping[str, Any], *, force: bool, path: str = "") -> list[str]:
    """Sets `wanted` into `existing` in place, tables merged key by key.

    Returns the dotted keys that already held another value; those are overwritten only with `force`
    (without it nothing is changed for them, and the caller refuses)."""
    conflicts: list[str] = []
    for key, value in wanted.items():
        dotted = f"{path}.{key}" if path else key
        if key not in existing:
            existing[key] = value
        elif isinstance(value, Mapping) and isinstance(existing[key], MutableMapping):
            conflicts += merge(existing[key], value, force=force, path=dotted)
        elif _plain(existing[key]) != value:
            conflicts.append(dotted)
            if force:
                existing[key] = value
    return conflicts


def _plain(value: Any) -> Any:
    """tomlkit items compared as the Python values they hold."""
    return value.unwrap() if hasattr(value, "unwrap") else value


def write_codex(path: Path, target: Target, *, force: bool) -> list[str]:
    """Merges the Codex settings into `path`; returns the keys overwritten (only with `force`)."""
    text = _read(path)
    try:
        document = tomlkit.parse(text)
    except tomlkit.exceptions.ParseError as exc:
        raise DFlashError(f"{path} is not valid TOML ({exc}); fix it or add the settings by hand") from None
    conflicts = merge(document, codex_settings(target), force=force)
    _refuse_unless(force, conflicts, path)
    _replace(path, tomlkit.dumps(document))
    return conflicts


def write_opencode(path: Path, target: Target, *, force: bool) -> list[str]:
    """Merges the OpenCode provider into `path`; returns the keys overwritten (only with `force`)."""
    text = _read(path)
    try:
        document = json.loads(text) if text.strip() else {}
    except json.JSONDecodeError as exc:
        raise DFlashError(f"{path} is not plain JSON ({exc.msg}, line {exc.lineno}; comments are not kept "
                          "by this writer): add the settings by hand") from None
    if not isinstance(document, dict):
        raise DFlashError(f"{path} does not hold a JSON object")
    conflicts = merge(document, opencode_settings(target), force=force)
    _refuse_unless(force, conflicts, path)
    _replace(path, json.dumps(document, indent=2) + "\n")
    return conflicts


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return ""
    except (OSError, UnicodeDecodeError) as exc:
        raise DFlashError(f"cannot read {path}: {exc}") from None


def _refuse_unless(force: bool, conflicts: list[str], path: Path) -> None:
    if conflicts and not force:
        raise DFlashError(f"{path} already sets {', '.join(conflicts)} to other values; nothing was written "
                          "(--force overwrites those keys, keeping the rest of the file)")


def _replace(path: Path, text: str) -> None:
    """Writes through a temporary file in the same folder, so a failed write leaves the old file whole."""
    temporary: str | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        mode = path.stat().st_mode & 0o777 if path.exists() else 0o600
        with tempfile.NamedTemporaryFile("w", encoding="utf-8", dir=path.parent, prefix=f".{path.name}.",
                                         delete=False) as handle:
            temporary = handle.name
            handle.write(text)
        os.chmod(temporary, mode)
        os.replace(temporary, path)
    except OSError as exc:
        if temporary is not None and os.path.exists(temporary):
            os.unlink(temporary)
        raise DFlashError(f"cannot write {path}: {exc.strerror or exc}") from None
