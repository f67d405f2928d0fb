"""`dflash bench speed` and `dflash bench acceptance` end to end on the CPU with the default model (JSON results)."""

from __future__ import annotations

import json
import os
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
    args = ["bench", "speed", "--prompts-file", str(prompts), "--max-tokens", "12", "--runs", "2", "--baseline-runs", "1",
            "--modes", "transformers,ar,linear,ddtree,ddtree:8,linear@eager", "--ddtree-budget", "4", "--json", "--out", str(out_file),
            # every round speculates: where the gate measures plain steps faster a mode has no rounds to report
            "--always-speculate"]
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
    # the transformers baseline ran its own number of repetitions, our modes the median of theirs
    assert {mode: len(row["runs"]) for mode, row in saved["modes"].items()} == {
        "transformers": 1, "ar": 2, "linear": 2, "ddtree": 2, "ddtree:8": 2, "linear@eager": 2}


@pytest.mark.slow
def test_bench_acceptance_reports_sets_prompts_and_provenance(tmp_path: Path) -> None:
    code, chat = tmp_path / "code.jsonl", tmp_path / "chat.jsonl"
    write_prompt_file(code, ["Write a Python function that adds two numbers.", "Reverse a list in Python."])
    write_prompt_file(chat, ["Name three colours."])
    out_file = tmp_path / "acceptance.json"
    args = ["bench", "acceptance", "--prompts-file", str(code), "--prompts-file", str(chat), "--max-tokens", "16",
            "--json", "--out", str(out_file)]
    environment = {**os.environ, "DFLASH_ATTENTION": "sdpa"}  # recorded with the results
    done = subprocess.run(
        [sys.executable, "-m", "dflash", *args], capture_output=True, text=True, timeout=600, env=environment
    )
    assert done.returncode == 0, done.stderr[-2000:]
    printed = json.loads(done.stdout.strip().splitlines()[-1])
    saved = json.loads(out_file.read_text())
    assert printed == saved
    assert saved["environment"]["DFLASH_ATTENTION"] == "sdpa"
    assert saved["sets"].keys() == {"code", "chat"}
    assert saved["sets"]["code"]["prompts"] == 2 and saved["sets"]["chat"]["prompts"] == 1
    assert len(saved["per_prompt"]) == 3
    values = [p["acceptance_length"] for p in saved["per_prompt"]]
    assert all(1.0 <= v <= 16 for v in values)
    assert saved["acceptance_length"] == pytest.approx(sum(values) / 3, abs=1e-3)
    assert saved["spec"] == "ddtree" and saved["max_tokens"] == 16
    assert saved["command"].startswith("dflash bench acceptance") and saved["device"].startswith("cpu")
    assert "torch" in saved["versions"] and saved["date"] and saved["dtype"] == "float32"


def test_speed_repetitions_interleave_modes() -> None:
    """Repetition r of every mode runs before repetition r + 1 of any; a mode with fewer repetitions drops out."""
    from dflash.bench.speed import Runner, RunOutcome, interleaved_runs

    calls: list[tuple[str, int]] = []

    def runner(mode: str, tokens: int, tau: float) -> Runner:
        def run(ids: list[int]) -> RunOutcome:
            calls.append((mode, ids[0]))
            return RunOutcome(tokens, tau)

        return run

    advanced: list[int] = []
    results = interleaved_runs(
        {"base": runner("base", 3, 0.0), "ar": runner("ar", 4, 0.0), "spec": runner("spec", 4, 2.5)},
        {"base": 1, "ar": 2, "spec": 2},
        [[10], [20]],
        advance=advanced.append,
    )
    assert calls == [("base", 10), ("base", 20), ("ar", 10), ("ar", 20), ("spec", 10), ("spec", 20),
                     ("ar", 10), ("ar", 20), ("spec", 10), ("spec", 20)]
    assert len(advanced) == len(calls)
    assert {mode: len(row["runs"]) for mode, row in results.items()} == {"base": 1, "ar": 2, "spec": 2}
    assert results["ar"]["tokens_per_run"] == 8 and results["base"]["tokens_per_run"] == 6
    assert results["spec"]["acceptance_length"] == 2.5 and results["ar"]["acceptance_length"] is None
    assert all(row["tokens_per_s"] > 0 for row in results.values())


def test_speed_aggregates_decode_and_prefill_rates_per_pass() -> None:
    """Decode-only tokens/s: tokens of the decoding steps (the first token comes from the prefill) over decode
    seconds, summed over the prompts of a pass; prefill tokens/s: prefilled prompt tokens over prefill seconds."""
    from dflash.bench.speed import RunOutcome, interleaved_runs

    timed = iter([RunOutcome(5, prefilled_tokens=30, prefill_s=0.5, decode_s=0.25),
                  RunOutcome(9, prefilled_tokens=10, prefill_s=0.5, decode_s=0.75),  # pass 1: 12/1.0 decode, 40/1.0
                  RunOutcome(5, prefilled_tokens=30, prefill_s=0.25, decode_s=0.25),
                  RunOutcome(9, prefilled_tokens=10, prefill_s=0.25, decode_s=0.25)])  # pass 2: 12/0.5, 40/0.5
    results = interleaved_runs({"ar": lambda ids: next(timed), "transformers": lambda ids: RunOutcome(7)},
                               {"ar": 2, "transformers": 1}, [[1], [2]])
    assert results["ar"]["decode_tokens_per_s"] == pytest.approx(18.0)  # median of 12 and 24
    assert results["ar"]["prefill_tokens_per_s"] == pytest.approx(60.0)  # median of 40 and 80
    assert results["ar"]["tokens_per_run"] == 14 and results["ar"]["timed"].startswith("wall")
    # a runner that does not split its time (HF generate) has no such figures
    assert results["transformers"]["decode_tokens_per_s"] is None
    assert results["transformers"]["prefill_tokens_per_s"] is None
