"""Helpers of the tests that drive the real agent command lines (Claude Code, Codex) against a loopback server.

The command lines come from `clients/package.json` (exact versions, installed by `make install` into
`clients/node_modules`). Each run gets a fresh HOME and config folders and an environment built from nothing
but PATH, so no setting of the machine leaks in, and every switch that would make a client call its vendor
(telemetry, error reports, update checks, plugin sync) is off: the only address they reach is the test server.
Client settings come from `dflash connect`, the way a user gets them.
"""

from __future__ import annotations

import io
import os
import subprocess
from contextlib import redirect_stdout
from dataclasses import dataclass
from pathlib import Path

import pytest

from dflash.cli import main as dflash_main

CLIENTS_BIN = Path(__file__).resolve().parent.parent / "clients" / "node_modules" / ".bin"
KEY_ENV = "DFLASH_API_KEY"

# Vendor traffic off (Claude Code); each variable is read by the client itself.
QUIET_CLAUDE = {
    "DISABLE_TELEMETRY": "1",
    "DISABLE_AUTOUPDATER": "1",
    "DISABLE_ERROR_REPORTING": "1",
    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
}

# Codex settings kept beside the provider block: no analytics, no update check, and no plugin sync (which
# otherwise fetches a curated plugin list from the vendor at start).
QUIET_CODEX_TOML = """\
check_for_update_on_startup = false

[analytics]
enabled = false

[features]
plugins = false
"""


def client_binary(name: str) -> Path:
    """The installed command line, or a skip that says how to install it."""
    path = CLIENTS_BIN / name
    if not path.exists():
        pytest.skip(f"{name} is not installed in clients/node_modules: run `make install` (needs npm)")
    return path


def dflash_connect(*argv: str) -> str:
    """What `dflash connect ARGV` prints (run in-process: it only reads the server's /v1/models)."""
    out = io.StringIO()
    with redirect_stdout(out):
        code = dflash_main(["connect", *argv])
    assert code == 0, out.getvalue()
    return out.getvalue()


def sourced(exports: str, base: dict[str, str]) -> dict[str, str]:
    """The environment a POSIX shell has after sourcing `exports` on top of `base`."""
    result = subprocess.run(["sh", "-c", f"{exports}\nenv -0"], env=base, capture_output=True, check=True,
                            timeout=30)
    pairs = (item.split("=", 1) for item in result.stdout.decode().split("\0") if "=" in item)
    return dict(pairs)


@dataclass
class Sandbox:
    """A fresh home for one client run: HOME, config folders and a working folder."""

    root: Path

    def __post_init__(self) -> None:
        for folder in (self.home, self.work, self.codex_home):
            folder.mkdir(parents=True, exist_ok=True)

    @property
    def home(self) -> Path:
        return self.root / "home"

    @property
    def work(self) -> Path:
        return self.root / "work"

    @property
    def codex_home(self) -> Path:
        return self.home / ".codex"

    def base_env(self) -> dict[str, str]:
        return {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(self.home),
            "XDG_CONFIG_HOME": str(self.home / ".config"),
            "CLAUDE_CONFIG_DIR": str(self.home / ".claude"),
            "CODEX_HOME": str(self.codex_home),
            "LANG": "C.UTF-8",
            KEY_ENV: "test-key",
        }


@dataclass
class Run:
    code: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


def run_client(argv: list[str], env: dict[str, str], cwd: Path, timeout: float) -> Run:
    """Runs a client to completion; a client that hangs past `timeout` fails the test."""
    try:
        done = subprocess.run(argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{Path(argv[0]).name} still running after {timeout:.0f} s; output so far: "
                    f"{exc.stdout!r} {exc.stderr!r}")
    return Run(done.returncode, done.stdout, done.stderr)
