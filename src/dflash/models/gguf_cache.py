"""On-disk cache of dequantised GGUF checkpoints (fp32 safetensors + config + tokenizer).

Dequantising a GGUF costs about a second per 100M parameters on a CPU; reading the same weights back
from a safetensors file costs a fraction of that. An entry is keyed by the GGUF's resolved path, size
and modification time (so a replaced file is never served stale), by this cache's format version and
by the `ModelConfig` field set. Files of one entry, in `<cache dir>/gguf/`:

    <key>.safetensors      weights under Hugging Face names, float32
    <key>.tokenizer.json   the tokenizer built from the GGUF metadata (absent if the file has none)
    <key>.json             config, tokenizer conventions, source; written last, marks the entry complete

Each file is written as a temporary tagged with the writer's pid, then renamed. Temporaries of writers that
died mid-write are removed the next time the cache is used.

The directory is `platformdirs.user_cache_dir("dflash")`, or `$DFLASH_CACHE_DIR`; `DFLASH_NO_CACHE=1`
turns the cache off. Failing to write the cache is never an error: the model is still returned.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from dflash import environment
from dflash.cache_paths import cache_root, remove_stale_temporaries, temporary_name
from dflash.config import ModelConfig
from dflash.tokenizer import Tokenizer

__all__ = ["CachedModel", "cache_dir", "cache_enabled", "load_cached", "store"]

log = logging.getLogger(__name__)

# Bump when the loader's output for the same GGUF changes (name mapping, permutation, norm shift...).
CACHE_FORMAT = 1
_FREE_SPACE_MARGIN = 512 * 2**20


@dataclass
class CachedModel:
    config: ModelConfig
    weights: dict[str, torch.Tensor]
    tokenizer: Tokenizer | None


def cache_enabled() -> bool:
    return environment.gguf_cache_enabled()


def cache_dir() -> Path:
    return cache_root() / "gguf"


def _key(path: Path) -> str:
    resolved = path.resolve()
    st = resolved.stat()
    fields = ",".join(f.name for f in dataclasses.fields(ModelConfig))
    ident = f"{resolved}|{st.st_size}|{st.st_mtime_ns}|{CACHE_FORMAT}|{fields}"
    return hashlib.sha256(ident.encode()).hexdigest()[:32]


def _entry(path: Path) -> tuple[Path, Path, Path]:
    base = cache_dir() / _key(path)
    return base.with_suffix(".json"), base.with_suffix(".safetensors"), base.with_suffix(".tokenizer.json")


def load_cached(path: Path) -> CachedModel | None:
    """The cached checkpoint of `path`, or None when there is none (or it is unreadable)."""
    if not cache_enabled():
        return None
    _sweep()
    try:
        meta_file, weights_file, tok_file = _entry(path)
        if not meta_file.is_file() or not weights_file.is_file():
            return None
        meta = json.loads(meta_file.read_text(encoding="utf-8"))
        config = _config_from_json(meta["config"])
        tokenizer = None
        if meta.get("tokenizer") is not None:
            tokenizer = Tokenizer.from_serialized(tok_file.read_text(encoding="utf-8"), meta["tokenizer"])
        weights = load_file(str(weights_file))
    except Exception as exc:  # a damaged entry: forget it and load from the GGUF
        log.warning("ignoring unreadable GGUF cache entry for %s: %s", path, exc)
        _remove(*_entry(path))
        return None
    return CachedModel(config, weights, tokenizer)


def store(
    path: Path, config: ModelConfig, weights: dict[str, torch.Tensor], tokenizer: Tokenizer | None
) -> Path | None:
    """Write the cache entry of `path`; returns the weights file, or None if it was not written."""
    if not cache_enabled():
        return None
    try:
        meta_file, weights_file, tok_file = _entry(path)
        directory = meta_file.parent
        directory.mkdir(parents=True, exist_ok=True)
        _sweep()  # before the free-space check: a dead writer's temporary may be what fills the disk
        needed = sum(t.numel() * 4 for t in weights.values())
        if shutil.disk_usage(directory).free < needed + _FREE_SPACE_MARGIN:
            log.warning("not caching %s: less than %d MiB free in %s", path, needed // 2**20, directory)
            return None
        _forget_older_entries(directory, path)
        tmp = _tmp_name(weights_file)
        save_file({k: v.to(torch.float32).contiguous() for k, v in weights.items()}, str(tmp))
        os.replace(tmp, weights_file)
        if tokenizer is not None:
            tmp = _tmp_name(tok_file)
            tmp.write_text(tokenizer.to_json(), encoding="utf-8")
            os.replace(tmp, tok_file)
        meta = {
            "format": CACHE_FORMAT,
            "source": str(path.resolve()),
            "config": _config_to_json(config),
            "tokenizer": tokenizer.info() if tokenizer is not None else None,
        }
        tmp = _tmp_name(meta_file)
        tmp.write_text(json.dumps(meta), encoding="utf-8")
        os.replace(tmp, meta_file)
        return weights_file
    except OSError as exc:
        log.warning("could not write the GGUF cache for %s: %s", path, exc)
        return None


def _forget_older_entries(directory: Path, path: Path) -> None:
    """Remove entries made from earlier versions of the same file (same path, other size or mtime)."""
    source = str(path.resolve())
    for meta_file in directory.glob("*.json"):
        if meta_file.name.endswith(".tokenizer.json"):
            continue
        try:
            if json.loads(meta_file.read_text(encoding="utf-8")).get("source") != source:
                continue
        except (OSError, ValueError, AttributeError):
            continue
        base = meta_file.with_suffix("")
        _remove(meta_file, base.with_suffix(".safetensors"), base.with_suffix(".tokenizer.json"))


def _tmp_name(final: Path) -> Path:
    return temporary_name(final)


def _sweep() -> None:
    for stale in remove_stale_temporaries(cache_dir()):
        log.info("removed %s, left by a writer that stopped mid-write", stale)


def _remove(*files: Path) -> None:
    for f in files:
        with contextlib.suppress(OSError):
            f.unlink(missing_ok=True)


def _config_to_json(config: ModelConfig) -> dict[str, Any]:
    return dataclasses.asdict(config)


def _config_from_json(raw: dict[str, Any]) -> ModelConfig:
    raw = dict(raw)
    raw["layer_types"] = tuple(raw["layer_types"])
    raw["eos_token_ids"] = tuple(raw.get("eos_token_ids", ()))
    raw["moe_layers"] = tuple(raw.get("moe_layers", ()))
    return ModelConfig(**raw)
