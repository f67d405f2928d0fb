"""Access to the golden vectors in ../shared/golden (skips cleanly when they are absent)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

GOLDEN = Path(__file__).resolve().parents[2] / "shared" / "golden"


def golden_dir(name: str) -> Path:
    path = GOLDEN / name
    if not path.is_dir():
        pytest.skip(f"golden vectors {path} not available")
    return path


def load_dflash_tiny() -> tuple[dict[str, torch.Tensor], dict[str, Any], Path]:
    from safetensors.torch import load_file

    path = golden_dir("dflash-tiny")
    return load_file(str(path / "golden.safetensors")), json.loads((path / "golden.json").read_text()), path
