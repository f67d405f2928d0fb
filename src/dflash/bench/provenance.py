"""Where a measurement came from: date, device, library versions, the command line (recorded in results files)."""

from __future__ import annotations

import datetime as dt
import platform
import sys
from typing import Any

import torch


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def versions() -> dict[str, str]:
    found = {"python": platform.python_version(), "torch": torch.__version__}
    try:
        import transformers

        found["transformers"] = transformers.__version__
    except ImportError:
        pass
    return found


def provenance(device: torch.device) -> dict[str, Any]:
    """date (UTC), device, versions and the `dflash ...` command that is running."""
    return {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "device": device_name(device),
        "versions": versions(),
        "command": "dflash " + " ".join(sys.argv[1:]),
    }
