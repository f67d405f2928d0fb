"""Access to the golden vectors in tests/data/golden (each folder's README says how they were produced).

The vectors are part of the repository, so a missing file is a broken checkout: the tests that need it fail
rather than skip, since a skip would hide that the lossless and reference checks never ran.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

GOLDEN = Path(__file__).resolve().parent / "data" / "golden"


def golden_dir(name: str) -> Path:
    path = GOLDEN / name
    if not path.is_dir():
        pytest.fail(f"golden vectors {path} are missing (they belong to the repository)", pytrace=False)
    return path


def golden_file(name: str, filename: str) -> Path:
    path = golden_dir(name) / filename
    if not path.is_file():
        pytest.fail(f"golden file {path} is missing (it belongs to the repository)", pytrace=False)
    return path


def load_dflash_tiny() -> tuple[dict[str, torch.Tensor], dict[str, Any], Path]:
    from safetensors.torch import load_file

    tensors = load_file(str(golden_file("dflash-tiny", "golden.safetensors")))
    meta = json.loads(golden_file("dflash-tiny", "golden.json").read_text())
    return tensors, meta, golden_dir("dflash-tiny")
