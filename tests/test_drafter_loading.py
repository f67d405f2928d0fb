"""Drafter checkpoints: both config layouts, refusal of drafters that do not fit, sliding-window layers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from dflash.config import ModelConfig
from dflash.drafter.loader import load_drafter
from dflash.drafter.model import DFlashDrafter, DrafterConfig, default_target_layer_ids
from dflash.errors import DrafterMismatchError, ModelLoadError
from tests.golden import golden_dir


@pytest.fixture()
def tiny(tmp_path: Path) -> tuple[Path, ModelConfig]:
    path = golden_dir("dflash-tiny")
    target = ModelConfig.from_hf(json.loads((path / "target" / "config.json").read_text()))
    drafter = tmp_path / "drafter"
    shutil.copytree(path / "drafter", drafter)
    return drafter, target


def _edit(folder: Path, **changes: object) -> None:
    raw = json.loads((folder / "config.json").read_text())
    for key, value in changes.items():
        if key.startswith("dflash_"):
            raw["dflash_config"][key.removeprefix("dflash_")] = value
        else:
            raw[key] = value
    (folder / "config.json").write_text(json.dumps(raw))


def test_top_level_dflash_fields_load_the_same(tiny: tuple[Path, ModelConfig]) -> None:
    folder, target = tiny
    nested = load_drafter(str(folder), target)
    raw = json.loads((folder / "config.json").read_text())
    fields = raw.pop("dflash_config")
    raw.update(fields)
    (folder / "config.json").write_text(json.dumps(raw))
    flat = load_drafter(str(folder), target)
    assert flat.config == nested.config
    assert default_target_layer_ids(6, 2) == [1, 3] and default_target_layer_ids(30, 1) == [15]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"dflash_mask_token_id": 5000}, "mask_token_id 5000 outside the vocabulary"),
        ({"dflash_target_layer_ids": [1, 9]}, "target_layer_ids [9] outside"),
        ({"vocab_size": 2048}, "vocabulary 2048 != target vocabulary 1024"),
    ],
)
def test_drafters_that_do_not_fit_are_refused(tiny: tuple[Path, ModelConfig], change: dict[str, object],
                                              message: str) -> None:
    folder, target = tiny
    _edit(folder, **change)
    with pytest.raises(DrafterMismatchError) as info:
        load_drafter(str(folder), target)
    assert message in str(info.value) and str(folder) in str(info.value)


def test_hidden_size_mismatch_is_refused(tiny: tuple[Path, ModelConfig]) -> None:
    folder, target = tiny
    import dataclasses

    with pytest.raises(DrafterMismatchError, match="hidden size 128 != target hidden size 256"):
        load_drafter(str(folder), dataclasses.replace(target, hidden_size=256, num_heads=8))


def test_missing_weights_are_refused(tiny: tuple[Path, ModelConfig]) -> None:
    folder, target = tiny
    (folder / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"no model\.safetensors"):
        load_drafter(str(folder), target)


def test_sliding_layers_are_causal_inside_their_window_and_full_layers_are_not() -> None:
    raw = {
        "num_hidden_layers": 2, "num_target_layers": 6, "hidden_size": 32, "intermediate_size": 64,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "vocab_size": 64, "block_size": 4,
        "dflash_config": {"mask_token_id": 63, "target_layer_ids": [1]},
        "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 3,
    }
    drafter = DFlashDrafter(DrafterConfig.from_dict(raw))
    masks = drafter._inference_masks(torch.arange(10, 14)[None], torch.arange(10)[None])
    assert masks[False] is None  # full layer: every block query sees every key, both ways
    sliding = masks[True]
    assert sliding is not None
    visible = sliding[0, 0]  # [block, context + block]
    # block row 0 at position 10 sees positions 8, 9 (context) and 10 (itself) only
    assert visible[0].nonzero().squeeze(-1).tolist() == [8, 9, 10]
    # block row 3 at position 13 sees 11, 12, 13 (all inside the block, causal)
    assert visible[3].nonzero().squeeze(-1).tolist() == [11, 12, 13]
