"""`dflash bench speed` end to end on the CPU: every mode on the default model, one JSON object with the ratios."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dflash.training.prompts import write_prompt_file


@pytest.mark.slow
def test_bench_speed_reports_every_mode(tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    write_prompt_file(prompts, ["Write a Python function that adds two numbers.", "Name three colours."])
    out_file = tmp_path / "speed.json"
    args = ["bench", "speed", "--prompts-file", str(prompts), "--max-tokens", "12", "--runs", "1",
            "--modes", "transformers,ar,linear,ddtree,ddtree:8,linear@eager", "--ddtree-budget", "4", "--json", "--out", str(out_file)]
    done = subprocess.run([sys.executable, "-m", "dflash", *args], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    printed = json.loads(done.stdout.strip().splitlines()[-1])
    saved = json.loads(out_file.read_text())
    assert printed["modes"].keys() == saved["modes"].keys() == {"transformers", "ar", "linear", "ddtree", "ddtree:8", "linear@eager"}
    assert saved["prompts"] == 2 and saved["drafter"] is True
    for mode, row in saved["modes"].items():
        assert row["tokens_per_s"] > 0 and row["tokens_per_run"] > 0, mode
    assert saved["modes"]["linear"]["acceptance_length"] >= 1.0
    assert saved["modes"]["ddtree"]["acceptance_length"] >= 1.0
    # greedy everywhere: every mode produces the same number of tokens
    assert len({row["tokens_per_run"] for row in saved["modes"].values()}) == 1
    assert saved["ratios"]["ar/transformers"] > 0 and "command" in saved
