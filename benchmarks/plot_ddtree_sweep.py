"""Plot DDTree acceptance length and tokens/s per budget (with linear DFlash and plain decoding as references).

Takes either one `dflash bench speed` result per budget (modes `ddtree`, `linear`, `ar`; CPU sweep files) or one
result holding every budget as `ddtree:N` modes (`scripts/gpu_bench.sh sweep`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def budget_rows(results: list[dict[str, Any]]) -> list[dict[str, float]]:
    """Per budget: DDTree and linear acceptance, and their speed relative to plain decoding."""
    rows = []
    for result in results:
        modes, ar = result["modes"], result["modes"]["ar"]["tokens_per_s"]
        linear = modes["linear"]
        trees = {int(name.split(":")[1]): mode for name, mode in modes.items() if name.startswith("ddtree:")}
        if "ddtree" in modes:
            trees[int(result["ddtree_budget"])] = modes["ddtree"]
        for budget, tree in trees.items():
            rows.append({"budget": budget, "ddtree_tau": tree["acceptance_length"],
                         "ddtree_speed": tree["tokens_per_s"] / ar, "linear_tau": linear["acceptance_length"],
                         "linear_speed": linear["tokens_per_s"] / ar})
    return sorted(rows, key=lambda row: row["budget"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("results", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    rows = budget_rows([json.loads(p.read_text()) for p in args.results])
    budgets = [row["budget"] for row in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(budgets, [row["ddtree_tau"] for row in rows], "o-", label="DDTree")
    left.plot(budgets, [row["linear_tau"] for row in rows], "s--", label="linear DFlash")
    left.set_xscale("log", base=2)
    left.set_xlabel("tree budget (nodes)")
    left.set_ylabel("acceptance length")
    left.legend()
    right.plot(budgets, [row["ddtree_speed"] for row in rows], "o-", label="DDTree / plain")
    right.plot(budgets, [row["linear_speed"] for row in rows], "s--", label="linear / plain")
    right.axhline(1.0, color="gray", linewidth=0.8)
    right.set_xscale("log", base=2)
    right.set_xlabel("tree budget (nodes)")
    right.set_ylabel("speed relative to plain decoding")
    right.legend()
    first = json.loads(args.results[0].read_text())
    fig.suptitle(f"{first['model']} on {first['device']}")
    fig.tight_layout()
    fig.savefig(args.out, dpi=100)


if __name__ == "__main__":
    main()
