"""Bar chart of linear acceptance length per evaluation set, one bar group per drafter version.

    python benchmarks/plot_acceptance_versions.py v3=results/ddtree_replay_acceptance_h100_drafter_v3.json \
        v4=results/ddtree_replay_acceptance_h100_drafter_v4.json v5=results/ddtree_replay_acceptance_h100_drafter_v5.json \
        v6=results/ddtree_replay_acceptance_h100.json \
        --bar 3.0 --out results/drafter_acceptance_versions.png

Each file is a `dflash train eval` or `dflash bench acceptance` result (per-set `acceptance_length`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("versions", nargs="+", help="LABEL=RESULT.json")
    parser.add_argument("--bar", type=float, default=None, help="draw a horizontal target line here")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    results = {}
    for item in args.versions:
        label, _, path = item.partition("=")
        results[label] = json.loads(Path(path).read_text())["sets"]
    sets = list(next(iter(results.values())))
    width = 0.8 / len(results)
    fig, axis = plt.subplots(figsize=(8, 4))
    for index, (label, per_set) in enumerate(results.items()):
        values = [per_set[name]["acceptance_length"] for name in sets]
        bars = axis.bar([i + index * width for i in range(len(sets))], values, width, label=label)
        axis.bar_label(bars, fmt="%.2f", fontsize=8)
    if args.bar is not None:
        axis.axhline(args.bar, color="gray", linestyle="--", linewidth=0.8, label=f"target {args.bar:g}")
    axis.set_xticks([i + width * (len(results) - 1) / 2 for i in range(len(sets))], sets)
    axis.set_ylabel("acceptance length (linear, 256 tokens)")
    axis.set_ylim(0, max(v["acceptance_length"] for s in results.values() for v in s.values()) * 1.3)
    axis.legend(loc="upper left", ncol=3, fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=100)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
