"""Where `dflash serve` gets its API key, and how the start-up banner names it without printing it.

Sources, first match wins: `--api-key KEY` (visible to every user of the machine in `ps`), `--api-key-file
PATH` (first line of the file), or the environment variable `DFLASH_API_KEY`. A source that is given but
unusable (missing or unreadable file, empty key) stops start-up with an error naming it.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from dflash import environment
from dflash.errors import DFlashError

ENV_VAR = environment.API_KEY


@dataclass(frozen=True)
class APIKey:
    value: str
    python: str  # a Python expression that yields the key, for the banner's SDK lines
    shell: str  # shell text that yields the key inside double quotes, for the banner's command lines
    source: str  # where it came from, in words


def load_api_key(flag: str | None, file: str | None, environ: Mapping[str, str]) -> APIKey | None:
    """The key from `--api-key`, `--api-key-file` or `$DFLASH_API_KEY`; None when none is given."""
    if flag is not None and file is not None:
        raise DFlashError("give the API key once: --api-key or --api-key-file, not both")
    if flag is not None:
        return APIKey(_checked(flag, "--api-key"), '"<your key>"', "<your key>", "--api-key")
    if file is not None:
        path = Path(file).expanduser()
        quoted = shlex.quote(str(path))
        return APIKey(_read_key_file(path), f"open({str(path)!r}).read().strip()", f"$(cat {quoted})", str(path))
    value = environment.api_key(environ)
    if value is None:
        return None
    return APIKey(_checked(value, f"${ENV_VAR}"), f'os.environ["{ENV_VAR}"]', f"${ENV_VAR}", f"${ENV_VAR}")


def _read_key_file(path: Path) -> str:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise DFlashError(f"--api-key-file {path}: not UTF-8 text") from None
    except OSError as exc:
        raise DFlashError(f"--api-key-file {path}: {exc.strerror or exc}") from None
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        raise DFlashError(f"--api-key-file {path} is empty")
    if len(lines) > 1:
        raise DFlashError(f"--api-key-file {path} holds {len(lines)} lines; it must hold only the key")
    return _checked(lines[0], f"--api-key-file {path}")


def _checked(key: str, where: str) -> str:
    key = key.strip()
    if not key:
        raise DFlashError(f"{where}: the API key is empty")
    # the key travels in an HTTP header, which carries printable ASCII only
    if not key.isascii() or not key.isprintable():
        raise DFlashError(f"{where}: the API key must be printable ASCII characters")
    return key
