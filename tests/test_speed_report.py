"""The comparing figures of a speed result (`dflash.bench.speed_report`): wall ratios between our modes, decode-only
ratios against llama.cpp, llama-bench's report as a row, and the printed table."""

from __future__ import annotations

from typing import Any

import pytest

from dflash.bench.llama_cpp_peer import parse_llama_bench_json
from dflash.bench.speed_report import DECODE, WALL, format_speed_table, llama_cpp_row, speed_ratios
from tests.llama_bench_stand_in import REAL_OUTPUT


def _ours(wall: float, decode: float | None, prefill: float | None, tau: float | None = None) -> dict[str, Any]:
    return {"tokens_per_s": wall, "tokens_per_run": 64, "runs": [wall], "acceptance_length": tau, "timed": WALL,
            "decode_tokens_per_s": decode, "prefill_tokens_per_s": prefill}


def _llama_report() -> dict[str, Any]:
    parsed = parse_llama_bench_json(REAL_OUTPUT.read_text())
    return {"command": "llama-bench -m m.gguf -t 2", **parsed.info, "prompt": parsed.prompt.as_dict(),
            "decode": parsed.decode.as_dict(), "peak_rss_mib": 150.0}


def test_the_llama_cpp_row_carries_decode_and_prompt_figures() -> None:
    report = _llama_report()
    row = llama_cpp_row(report)
    assert row["tokens_per_s"] == row["decode_tokens_per_s"] == report["decode"]["tokens_per_s"]
    assert row["prefill_tokens_per_s"] == report["prompt"]["tokens_per_s"]
    assert row["runs"] == report["decode"]["samples_ts"] and row["timed"] == DECODE
    assert row["acceptance_length"] is None and row["tokens_per_run"] == report["decode"]["tokens"]


def test_ratios_against_llama_cpp_compare_decode_with_decode() -> None:
    modes = {
        "transformers": _ours(10.0, None, None),
        "ar": _ours(40.0, 50.0, 400.0),
        "ddtree": _ours(60.0, 80.0, 380.0, tau=2.5),
        "llama.cpp": {**_ours(100.0, 100.0, 300.0), "timed": DECODE},
    }
    ratios = speed_ratios(modes)
    assert ratios["ar/llama.cpp"] == pytest.approx(0.5) and ratios["ddtree/llama.cpp"] == pytest.approx(0.8)
    assert ratios["ddtree/ar"] == pytest.approx(1.5) and ratios["ar/transformers"] == pytest.approx(4.0)
    # llama-bench's decode figure is never set against a wall figure, and HF generate has no decode figure
    assert not {"llama.cpp/ar", "llama.cpp/transformers", "transformers/llama.cpp"} & ratios.keys()


def test_the_table_shows_decode_prefill_memory_and_the_command() -> None:
    report = _llama_report()
    modes = {"ar": _ours(40.0, 50.0, 400.0), "llama.cpp": llama_cpp_row(report)}
    result = {"model": "m", "weights": "quantized", "cpu_matmul": None, "device": "cpu", "prompts": 2,
              "max_tokens": 64, "modes": modes, "ratios": speed_ratios(modes),
              "peak_rss_mib": {"ours": 300.0, "llama.cpp": 150.0, "ours/llama.cpp": 2.0}, "llama_cpp": report}
    lines = format_speed_table(result).splitlines()
    ar_row = next(line for line in lines if line.startswith("ar "))
    llama_row = next(line for line in lines if line.startswith("llama.cpp "))
    assert ar_row.split() == ["ar", "40.00", "50.00", "400.00", "-"]
    decode, prefill = report["decode"]["tokens_per_s"], report["prompt"]["tokens_per_s"]
    assert llama_row.split() == ["llama.cpp", "-", f"{decode:.2f}", f"{prefill:.2f}", "-"]  # no wall figure
    assert f"ar/llama.cpp: {50.0 / decode:.2f}x (decode only)" in lines
    assert "peak RSS: ours 300 MiB, llama.cpp 150 MiB, ours/llama.cpp 2.00x" in lines
    assert lines[-1] == f"llama.cpp build {report['build_commit']}: llama-bench -m m.gguf -t 2"
