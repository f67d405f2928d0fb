"""The figures of a `dflash bench speed` result that compare modes: ratios, the llama.cpp row, the printed table.

Ratios between our modes and the transformers baseline compare `tokens_per_s` (wall time, prefill included), which
every one of them measures alike. llama-bench measures no such figure for generation (its tg test has no prompt),
so the ratios against llama.cpp compare decode-only figures: our `decode_tokens_per_s` over its tg tokens/s.
"""

from __future__ import annotations

from typing import Any

from dflash.bench.llama_cpp_peer import LLAMA_CPP_MODE

WALL = "wall, prefill included"  # a row's `timed`: completion tokens over the whole generation
DECODE = "decode only (llama-bench tg)"  # tokens generated one at a time, no prompt
_WALL_BASES = ("ar", "transformers")


def llama_cpp_row(report: dict[str, Any]) -> dict[str, Any]:
    """llama-bench's report (`llama_cpp_peer.run_llama_bench`) as a row of `modes`, keyed as our modes' rows are."""
    decode, prompt = report["decode"], report["prompt"]
    return {
        "tokens_per_s": decode["tokens_per_s"],
        "tokens_per_run": decode["tokens"],
        "runs": decode["samples_ts"],
        "acceptance_length": None,
        "timed": DECODE,
        "decode_tokens_per_s": decode["tokens_per_s"],
        "prefill_tokens_per_s": prompt["tokens_per_s"],
    }


def speed_ratios(modes: dict[str, dict[str, Any]]) -> dict[str, float]:
    """`MODE/ar` and `MODE/transformers` on wall tokens/s; `MODE/llama.cpp` on decode-only tokens/s."""
    ratios: dict[str, float] = {}
    for base in _WALL_BASES:
        if base in modes:
            for mode, row in modes.items():
                if mode not in (base, LLAMA_CPP_MODE):
                    ratios[f"{mode}/{base}"] = round(row["tokens_per_s"] / modes[base]["tokens_per_s"], 3)
    if LLAMA_CPP_MODE in modes:
        peer = modes[LLAMA_CPP_MODE]["decode_tokens_per_s"]
        for mode, row in modes.items():
            if mode != LLAMA_CPP_MODE and row.get("decode_tokens_per_s"):
                ratios[f"{mode}/{LLAMA_CPP_MODE}"] = round(row["decode_tokens_per_s"] / peer, 3)
    return ratios


def format_speed_table(result: dict[str, Any]) -> str:
    products = f", {result['cpu_matmul']} products" if result.get("cpu_matmul") else ""
    lines = [f"{result['model']} ({result['weights']} weights{products}) on {result['device']}, "
             f"{result['prompts']} prompts x {result['max_tokens']} tokens"]
    lines.append(f"{'mode':<18}{'tokens/s':>10}{'decode/s':>10}{'prefill/s':>11}{'acceptance':>12}")
    for mode, r in result["modes"].items():
        wall = f"{r['tokens_per_s']:.2f}" if r.get("timed", WALL) == WALL else "-"  # llama-bench has no wall figure
        tau = f"{r['acceptance_length']:.2f}" if r["acceptance_length"] else "-"
        lines.append(f"{mode:<18}{wall:>10}{_figure(r.get('decode_tokens_per_s')):>10}"
                     f"{_figure(r.get('prefill_tokens_per_s')):>11}{tau:>12}")
    for name, value in result["ratios"].items():
        lines.append(f"{name}: {value:.2f}x" + (" (decode only)" if name.endswith(f"/{LLAMA_CPP_MODE}") else ""))
    memory = result.get("peak_rss_mib", {})
    if memory:
        lines.append("peak RSS: " + ", ".join(
            f"{name} {value:.2f}x" if "/" in name else f"{name} {value:.0f} MiB" for name, value in memory.items()
        ))
    if "llama_cpp" in result:
        peer = result["llama_cpp"]
        lines.append(f"llama.cpp build {peer.get('build_commit', '?')}: {peer['command']}")
    return "\n".join(lines)


def _figure(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"
