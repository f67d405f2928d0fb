"""Where dflash keeps files it can rebuild: `$DFLASH_CACHE_DIR`, else the platform's user cache dir."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cache_root"]


def cache_root() -> Path:
    """The cache directory shared by the GGUF cache (`gguf/`) and compiled kernels (`kernels/`)."""
    override = os.environ.get("DFLASH_CACHE_DIR")
    if override:
        return Path(override).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("dflash"))
