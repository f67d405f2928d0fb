"""A GGUF cache writer killed mid-write (`kill -9` during the first start) leaves a large temporary; the next
use of the cache removes it, while temporaries of writers still running are kept."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from dflash.cache_paths import STALE_AFTER_S, remove_stale_temporaries, temporary_name
from dflash.config import ModelConfig
from dflash.models import gguf_cache


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


@pytest.fixture
def live_pid() -> Iterator[int]:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        yield child.pid
    finally:
        child.kill()
        child.wait()


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("DFLASH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("DFLASH_NO_CACHE", raising=False)
    directory = gguf_cache.cache_dir()
    directory.mkdir(parents=True)
    return directory


def test_next_cache_use_removes_a_dead_writers_temporary(cache: Path, tmp_path: Path, live_pid: int) -> None:
    stale = cache / f"0123abcd.safetensors.tmp{dead_pid()}"
    stale.write_bytes(b"\0" * 4096)
    running = cache / f"4567cdef.safetensors.tmp{live_pid}"  # another process writing right now
    running.write_bytes(b"\0" * 4096)
    ours = temporary_name(cache / "89ab.json")  # this process's own
    ours.write_text("{}")
    entry = cache / "0123abcd.safetensors"  # finished entries are never touched
    entry.write_bytes(b"weights")
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")
    assert gguf_cache.load_cached(model) is None  # no entry for it; the sweep still ran
    assert not stale.exists()
    assert running.exists() and ours.exists() and entry.exists()


def test_an_old_temporary_is_removed_even_if_its_pid_is_reused(cache: Path, live_pid: int) -> None:
    # the pid now belongs to another process, but nothing wrote to the file for longer than any writer would pause
    reused = cache / f"0123abcd.safetensors.tmp{live_pid}"
    reused.write_bytes(b"\0")
    old = time.time() - STALE_AFTER_S - 60
    os.utime(reused, (old, old))
    fresh = cache / f"4567cdef.safetensors.tmp{live_pid}"
    fresh.write_bytes(b"\0")
    assert remove_stale_temporaries(cache) == [reused]
    assert fresh.exists()


def test_store_sweeps_and_leaves_no_temporary(cache: Path, tmp_path: Path) -> None:
    stale = cache / f"0123abcd.json.tmp{dead_pid()}"
    stale.write_text("{")
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")
    config = ModelConfig(architecture="llama", vocab_size=8, hidden_size=4, intermediate_size=8, num_layers=1,
                         num_heads=1, num_kv_heads=1, head_dim=4, rms_norm_eps=1e-6, rope_theta=10000.0,
                         max_position_embeddings=16, tie_word_embeddings=True, layer_types=("full_attention",))
    assert gguf_cache.store(model, config, {"w": torch.ones(2, 2)}, None) is not None
    assert not stale.exists()
    assert not [f for f in cache.iterdir() if ".tmp" in f.name]  # every file of the entry was renamed
    cached = gguf_cache.load_cached(model)
    assert cached is not None and torch.equal(cached.weights["w"], torch.ones(2, 2))


def test_a_missing_directory_is_no_error(tmp_path: Path) -> None:
    assert remove_stale_temporaries(tmp_path / "absent") == []



def test_assembling_the_packaged_gemma_file_sweeps_a_dead_writers_copy(cache: Path) -> None:
    """The packaged Gemma GGUF is assembled from its parts into the cache on first use; a start killed then leaves
    a temporary of its size beside it."""
    from dflash.models.packaged import GEMMA3_270M_FILE, gemma3_270m_path

    folder = cache.parent / "models"
    folder.mkdir(parents=True)
    stale = folder / f"{GEMMA3_270M_FILE}.tmp{dead_pid()}"
    stale.write_bytes(b"\0" * 1024)
    path = gemma3_270m_path()
    if path is None:
        pytest.fail("the Gemma-3-270M packages are not installed (make install installs them)")
    assert path.parent == folder and path.is_file()
    assert not stale.exists()
