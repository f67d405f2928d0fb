"""Bar charts of a peer table (`benchmarks/gpu_gguf_peers.py`'s `rows`): decode and prompt tokens/s per engine.

    python benchmarks/plot_gguf_peers.py results/gpu_peers_h100.json --out results/gpu_peers_h100.png

One bar per row (llama.cpp, then dflash by weight form and input rounding), the decode panel with a line at the
issue's bar (`--bar`, times the first llama.cpp row's decode speed).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def label(row: dict[str, object]) -> str:
    if row["engine"] == "llama.cpp":
        return f"llama.cpp\n(run {row.get('run', '')})" if row.get("run") else "llama.cpp"
    inputs = str(row.get("inputs", "")).split(" ")[0]
    return f"dflash {row['weights']}" + (f"\n{inputs} inputs" if inputs else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("table", type=Path)
    parser.add_argument("--bar", type=float, default=1.2, help="decode target as a multiple of llama.cpp's")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    table = json.loads(args.table.read_text())
    rows = table["rows"]
    names = [label(row) for row in rows]
    colours = ["#888888" if row["engine"] == "llama.cpp" else "#1f77b4" for row in rows]
    figure, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for axis, key, title in ((axes[0], "decode_tok_s", "plain decoding, tokens/s"),
                             (axes[1], "prefill_tok_s", "prompt (512 tokens), tokens/s")):
        values = [float(row[key]) for row in rows]
        bars = axis.bar(range(len(rows)), values, color=colours)
        axis.bar_label(bars, labels=[f"{v:,.0f}" for v in values], fontsize=8)
        axis.set_xticks(range(len(rows)), names, fontsize=7)
        axis.set_title(title, fontsize=10)
    reference = next(float(row["decode_tok_s"]) for row in rows if row["engine"] == "llama.cpp")
    axes[0].axhline(args.bar * reference, color="#d62728", linestyle="--", linewidth=1)
    axes[0].text(len(rows) - 0.5, args.bar * reference, f"bar {args.bar}x llama.cpp", color="#d62728", fontsize=8,
                 ha="right", va="bottom")
    model = rows[0].get("model", "")
    figure.suptitle(f"{model} {rows[0].get('quant', '')}, {table.get('device', '')}, {table.get('date', '')[:10]}",
                    fontsize=10)
    figure.tight_layout()
    figure.savefig(args.out, dpi=110)


if __name__ == "__main__":
    main()
