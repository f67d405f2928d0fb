"""A trained drafter from a training run's folder (its `checkpoint.pt`) or from an exported drafter folder.

`dflash train export` rebuilds the run's drafter from its checkpoint; `dflash train fit --init-from` starts from
either kind of folder (or a packaged drafter's name). The checkpoint's config is the published layout, so a DFlash2
run comes back as a DFlash2 drafter.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from dflash.config import ModelConfig
from dflash.drafter.dflash2 import DFlash2Config, DFlash2Drafter
from dflash.drafter.loader import check_fits_target, drafter_config_from_dict, load_drafter
from dflash.drafter.model import DFlashDrafter

CHECKPOINT = "checkpoint.pt"


def drafter_from_run(run_dir: Path, device: torch.device | str = "cpu") -> tuple[DFlashDrafter, dict[str, Any]]:
    """The drafter saved in `run_dir`'s checkpoint (float32, as trained) and the checkpoint itself."""
    path = run_dir / CHECKPOINT
    state = torch.load(path, map_location=device, weights_only=False)
    config = drafter_config_from_dict(state["drafter_config"], str(path))
    drafter = DFlash2Drafter(config) if isinstance(config, DFlash2Config) else DFlashDrafter(config)
    drafter.load_state_dict(state["drafter"])
    return drafter.to(device), state


def load_start_drafter(name: str, target: ModelConfig, device: torch.device | str) -> DFlashDrafter:
    """A float32 drafter to continue training from: a run folder (it has a checkpoint and no config.json), else
    an exported drafter folder or a packaged drafter's name (`load_drafter`)."""
    folder = Path(name).expanduser()
    if (folder / CHECKPOINT).is_file() and not (folder / "config.json").is_file():
        drafter, _ = drafter_from_run(folder, device)
        check_fits_target(drafter.config, target, str(folder))
        return drafter
    return load_drafter(name, target, device=device, dtype=torch.float32)
