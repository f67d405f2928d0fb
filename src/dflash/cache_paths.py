"""Where dflash keeps files it can rebuild: `$DFLASH_CACHE_DIR`, else the platform's user cache dir; and the
clean-up of temporaries that writers killed mid-write (`kill -9`, power loss) left behind."""

from __future__ import annotations

import contextlib
import os
import re
import time
from pathlib import Path

from dflash import environment

__all__ = ["cache_root", "remove_stale_temporaries", "temporary_name"]

_TEMPORARY = re.compile(r"\.tmp(\d+)$")
STALE_AFTER_S = 3600.0  # a live writer touches its temporary every few seconds; an hour untouched is a dead one


def cache_root() -> Path:
    """The cache directory shared by the GGUF cache (`gguf/`) and compiled kernels (`kernels/`)."""
    override = environment.cache_dir()
    if override is not None:
        return override
    import platformdirs

    return Path(platformdirs.user_cache_dir("dflash"))


def temporary_name(final: Path) -> Path:
    """Where a writer of `final` writes before renaming: beside it, tagged with the writer's pid."""
    return final.with_name(f"{final.name}.tmp{os.getpid()}")


def remove_stale_temporaries(directory: Path, stale_after_s: float = STALE_AFTER_S) -> list[Path]:
    """Removes the temporaries (`temporary_name`) in `directory` whose writer is gone: its pid is no running
    process, or the file was not modified for `stale_after_s` (the pid may since belong to another process).
    Returns the files removed; a directory that cannot be read is left alone."""
    removed: list[Path] = []
    try:
        candidates = [(f, int(m.group(1))) for f in directory.iterdir() if (m := _TEMPORARY.search(f.name))]
    except OSError:
        return removed
    now = time.time()
    for path, pid in candidates:
        if pid == os.getpid():
            continue
        with contextlib.suppress(OSError):  # gone already (another sweeper), or not ours to remove
            if not _process_alive(pid) or now - path.stat().st_mtime > stale_after_s:
                path.unlink()
                removed.append(path)
    return removed


def _process_alive(pid: int) -> bool:
    if os.name != "posix":
        return True  # no harmless liveness probe there (os.kill would end the process): age decides
    try:
        os.kill(pid, 0)  # signal 0: only checks that the process exists
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by another user
    return True
