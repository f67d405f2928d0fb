"""A stand-in for llama.cpp's `llama-bench`: a small executable script that records its arguments and prints a
real `llama-bench -o json` output (tests/data/llama_bench_output.json, captured from llama-bench on the default
model, 2 threads, -p 40 -n 16 -r 2), or fails the ways a real one can."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

REAL_OUTPUT = Path(__file__).parent / "data" / "llama_bench_output.json"


def real_output() -> list[dict[str, Any]]:
    tests: list[dict[str, Any]] = json.loads(REAL_OUTPUT.read_text())
    return tests


def write_stand_in(
    folder: Path,
    *,
    output: str | None = None,
    exit_code: int = 0,
    signal_name: str | None = None,
    stderr: str = "",
    ballast_mib: int = 0,
) -> tuple[Path, Path]:
    """-> (the executable, the file where it writes its arguments as a JSON list). It prints `output` (default: the
    real output), writes `stderr`, holds `ballast_mib` MiB of written memory, then exits with `exit_code` or kills
    itself with `signal_name`."""
    executable, argv_file = folder / "llama-bench", folder / "llama_bench_argv.json"
    text = REAL_OUTPUT.read_text() if output is None else output
    executable.write_text(f"""#!{sys.executable}
import json, os, signal, sys
with open({str(argv_file)!r}, "w") as f:
    json.dump(sys.argv[1:], f)
ballast = b"x" * ({ballast_mib} * 2**20)  # written bytes: resident, unlike untouched zero pages
sys.stdout.write({text!r})
sys.stdout.flush()
sys.stderr.write({stderr!r})
sys.stderr.flush()
if {signal_name!r}:
    os.kill(os.getpid(), getattr(signal, {signal_name!r}))
sys.exit({exit_code})
""")
    executable.chmod(0o755)
    return executable, argv_file
