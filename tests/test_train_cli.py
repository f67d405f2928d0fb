"""`dflash train` end to end at toy scale on the CPU: data -> fit (and resume) -> export -> load -> eval."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dflash.drafter.loader import load_drafter
from dflash.training.datagen import read_examples
from dflash.training.prompts import write_prompt_file


def dflash(*args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "dflash", *args], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


@pytest.mark.slow
def test_train_pipeline(tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    write_prompt_file(prompts, ["Say hi.", "Name a fruit.", "What is 3+4?"])
    data = tmp_path / "data.jsonl.gz"
    dflash("train", "data", "--prompts", str(prompts), "--out", str(data), "--max-new-tokens", "12",
           "--batch-size", "2")
    examples = list(read_examples(data))
    assert len(examples) == 3 and all(0 < len(answer) <= 12 for _, answer in examples)

    run = tmp_path / "run"
    common = ["train", "fit", "--data", str(data), "--out", str(run), "--layers", "1", "--block-size", "8",
              "--batch-size", "2", "--anchors", "4", "--max-length", "64"]
    dflash(*common, "--steps", "2")
    first = torch.load(run / "checkpoint.pt", weights_only=False)
    assert first["step"] == 2
    resumed = dflash(*common, "--steps", "4")
    assert "resuming at step 2" in resumed
    assert torch.load(run / "checkpoint.pt", weights_only=False)["step"] == 4
    history = json.loads((run / "history.json").read_text())
    assert history["val_steps"] == [2, 4] and all(tau >= 1.0 for tau in history["val_acceptance"])

    drafter_dir = tmp_path / "drafter"
    dflash("train", "export", "--run", str(run), "--out", str(drafter_dir))
    config = json.loads((drafter_dir / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["block_size"] == 8
    from dflash.models.resolve import load_checkpoint

    drafter = load_drafter(str(drafter_dir), load_checkpoint("default").config)
    assert drafter.config.num_layers == 1

    grown_run = tmp_path / "grown"
    log = dflash("train", "fit", "--data", str(data), "--out", str(grown_run), "--init-from", str(drafter_dir),
                 "--layers", "2", "--intermediate-size", "2048", "--batch-size", "2", "--anchors", "4",
                 "--max-length", "64", "--steps", "1")
    assert "drafter 2 layers, MLP 2048" in log
    grown = torch.load(grown_run / "checkpoint.pt", weights_only=False)
    assert grown["drafter_config"]["block_size"] == 8 and grown["drafter_config"]["num_hidden_layers"] == 2

    report = tmp_path / "replay.json"
    dflash("train", "eval", "--draft", str(drafter_dir), "--prompts-file", str(prompts), "--max-tokens", "12",
           "--ddtree-budgets", "2,8", "--out", str(report))
    result = json.loads(report.read_text())
    assert result["sets"]["prompts"]["prompts"] == 3 and result["acceptance_length"] >= 1.0
    assert result["command"].startswith("dflash train eval --draft") and result["device"].startswith("cpu")
    assert set(result["ddtree_acceptance_length"]) == {"2", "8"}
    assert all(tau >= 1.0 for tau in result["sets"]["prompts"]["ddtree"].values())
