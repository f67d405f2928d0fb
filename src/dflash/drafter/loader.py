"""Load DFlash drafter checkpoints in the published layout and check that they fit their target."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from dflash.config import ModelConfig
from dflash.drafter.dflash2 import DFlash2Config, DFlash2Drafter, is_dflash2_config
from dflash.drafter.model import DFlashDrafter, DrafterConfig
from dflash.errors import DrafterMismatchError, ModelLoadError
from dflash.models.materialize import materialize

PACKAGED_DRAFTERS = Path(__file__).resolve().parent.parent / "drafters"
DEFAULT_DRAFTER = "smollm2-135m-instruct"
GEMMA3_270M_DRAFTER = "gemma3-270m"  # the drafter of `--model gemma3-270m`
_PACKAGED = (DEFAULT_DRAFTER, GEMMA3_270M_DRAFTER)


def resolve_drafter_path(name: str) -> Path:
    """`default` (or a packaged drafter's name) -> its folder inside the package; anything else is a path."""
    if name == "default" or name in _PACKAGED:
        path = PACKAGED_DRAFTERS / (DEFAULT_DRAFTER if name == "default" else name)
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"the packaged drafter {path.name} is missing from {path.parent}")
        return path
    path = Path(name).expanduser()
    if not path.exists():
        raise ModelLoadError(f"drafter path {path} does not exist")
    return path


def read_drafter_weights(folder: Path) -> dict[str, torch.Tensor]:
    """Single `model.safetensors` or shards listed in `model.safetensors.index.json`."""
    from safetensors.torch import load_file

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        weights: dict[str, torch.Tensor] = {}
        for shard in shards:
            if not (folder / shard).is_file():
                raise ModelLoadError(f"{index}: shard {shard} is missing")
            weights.update(load_file(str(folder / shard)))
        return weights
    single = folder / "model.safetensors"
    if not single.is_file():
        raise ModelLoadError(f"{folder}: no model.safetensors or model.safetensors.index.json")
    return load_file(str(single))


def check_fits_target(config: DrafterConfig, target: ModelConfig, source: str) -> None:
    """Refuse a drafter whose sizes or ids do not match the target, before any generation."""
    problems = []
    if config.hidden_size != target.hidden_size:
        problems.append(f"hidden size {config.hidden_size} != target hidden size {target.hidden_size}")
    if config.vocab_size != target.vocab_size:
        problems.append(f"vocabulary {config.vocab_size} != target vocabulary {target.vocab_size}")
    bad_layers = [i for i in config.target_layer_ids if not 0 <= i < target.num_layers]
    if bad_layers:
        problems.append(f"target_layer_ids {bad_layers} outside the target's {target.num_layers} layers")
    if not 0 <= config.mask_token_id < target.vocab_size:
        problems.append(f"mask_token_id {config.mask_token_id} outside the vocabulary of {target.vocab_size}")
    if config.block_size < 2:
        problems.append(f"block_size {config.block_size} < 2")
    if problems:
        raise DrafterMismatchError(f"drafter {source} does not fit the target: " + "; ".join(problems))


def drafter_config_from_dict(raw: dict[str, Any], source: str) -> DrafterConfig:
    """A DFlash2 config (`DFlash2Config`) where `raw` has DFlash2 fields, else a DFlash one."""
    return DFlash2Config.from_dict(raw, source) if is_dflash2_config(raw) else DrafterConfig.from_dict(raw, source)


def load_drafter(
    name: str,
    target: ModelConfig,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> DFlashDrafter:
    folder = resolve_drafter_path(name)
    config_path = folder / "config.json"
    try:
        raw = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{config_path}: cannot read drafter config ({exc})") from None
    config = drafter_config_from_dict(raw, str(config_path))
    check_fits_target(config, target, str(folder))
    weights = read_drafter_weights(folder)
    with torch.device("meta"):
        drafter = DFlash2Drafter(config) if isinstance(config, DFlash2Config) else DFlashDrafter(config)
    expected = drafter.state_dict()
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    if missing or unexpected:
        raise ModelLoadError(f"{folder}: drafter weights missing {missing[:5]} / unexpected {unexpected[:5]}")
    for key, tensor in weights.items():
        if tuple(tensor.shape) != tuple(expected[key].shape):
            raise ModelLoadError(
                f"{folder}: drafter tensor {key} has shape {tuple(tensor.shape)}, expected {tuple(expected[key].shape)}"
            )
    for key in list(weights):  # one tensor at a time, each file tensor freed once converted
        tensor = weights.pop(key)
        weights[key] = tensor.to(device, dtype) if tensor.is_floating_point() else tensor.to(device)
    drafter.load_state_dict(weights, assign=True)  # the converted tensors become the parameters: no second copy
    drafter = materialize(drafter, device).to(dtype)  # what the files do not hold (buffers computed below)
    drafter.rotary.recompute()  # RoPE frequencies stay float32 whatever the weight dtype
    return drafter.eval().requires_grad_(False)
