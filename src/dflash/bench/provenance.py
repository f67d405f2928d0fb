"""Where a measurement came from: date, device, library versions, the command line and the `DFLASH_*` environment
settings that change the engine's kernels (recorded in results files)."""

from __future__ import annotations

import datetime as dt
import json
import platform
import sys
from pathlib import Path
from typing import Any

import torch

from dflash import environment


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
    """date (UTC), device, versions, the `dflash ...` command that is running and the DFLASH_* variables set
    (recorded in every results file)."""
    return {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "device": device_name(device),
        "versions": versions(),
        "command": command_line(),
        "environment": environment.variables_set(),
    }


def command_line() -> str:
    """`dflash ...` for the CLI (however it was launched), `python SCRIPT ...` for a script."""
    if Path(sys.argv[0]).name in ("dflash", "__main__.py"):
        return "dflash " + " ".join(sys.argv[1:])
    return " ".join(["python", sys.argv[0], *sys.argv[1:]])


def write_result(result: dict[str, Any], out: Path | None, *, indent: int = 1) -> None:
    """Print a results object as JSON and, when `out` is given, write the same text there."""
    text = json.dumps(result, indent=indent)
    print(text)
    if out is not None:
        out.write_text(text + "\n")
