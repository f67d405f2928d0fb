"""Plot DDTree acceptance length and tokens/s per budget (with linear DFlash and plain decoding as references)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("results", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    runs = sorted((json.loads(p.read_text()) for p in args.results), key=lambda r: int(r["ddtree_budget"]))
    budgets = [int(r["ddtree_budget"]) for r in runs]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(budgets, [r["modes"]["ddtree"]["acceptance_length"] for r in runs], "o-", label="DDTree")
    left.plot(budgets, [r["modes"]["linear"]["acceptance_length"] for r in runs], "s--", label="linear DFlash")
    left.set_xscale("log", base=2)
    left.set_xlabel("tree budget (nodes)")
    left.set_ylabel("acceptance length")
    left.legend()
    right.plot(budgets, [r["ratios"]["ddtree/ar"] for r in runs], "o-", label="DDTree / plain")
    right.plot(budgets, [r["ratios"]["linear/ar"] for r in runs], "s--", label="linear / plain")
    right.axhline(1.0, color="gray", linewidth=0.8)
    right.set_xscale("log", base=2)
    right.set_xlabel("tree budget (nodes)")
    right.set_ylabel("speed relative to plain decoding")
    right.legend()
    fig.suptitle(f"{runs[0]['model']} on {runs[0]['device']}")
    fig.tight_layout()
    fig.savefig(args.out, dpi=100)


if __name__ == "__main__":
    main()
