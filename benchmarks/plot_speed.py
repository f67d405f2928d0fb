"""Bar chart of a `dflash bench speed` result (tokens/s per mode); with `ddtree:N` modes, a second panel with the
acceptance length and the speed-up over plain decoding per tree budget."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("result", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    result = json.loads(args.result.read_text())
    modes = result["modes"]
    budgets = sorted(int(m.split(":")[1]) for m in modes if m.startswith("ddtree:"))
    fig, axes = plt.subplots(1, 2 if budgets else 1, figsize=(12 if budgets else 7, 4.5), squeeze=False)
    bars = axes[0][0]
    names = list(modes)
    speeds = [modes[m]["tokens_per_s"] for m in names]
    drawn = bars.bar(range(len(names)), speeds, color=["tab:gray" if m.startswith("transformers") else "tab:blue"
                                                       for m in names])
    for rect, mode in zip(drawn, names, strict=True):
        tau = modes[mode]["acceptance_length"]
        label = f"{rect.get_height():.0f}" + (f"\nτ {tau:.2f}" if tau else "")
        bars.annotate(label, (rect.get_x() + rect.get_width() / 2, rect.get_height()), ha="center", va="bottom",
                      fontsize=8)
    bars.set_xticks(range(len(names)), names, rotation=30, ha="right")
    bars.set_ylabel("tokens/s (median of runs)")
    bars.set_title(f"{result['model']} on {result['device']}\n{result['prompts']} prompts x {result['max_tokens']} "
                   f"tokens, {result['dtype']}", fontsize=9)
    if budgets:
        curve = axes[0][1]
        base = modes["ar"]["tokens_per_s"] if "ar" in modes else None
        taus = [modes[f"ddtree:{b}"]["acceptance_length"] for b in budgets]
        curve.plot(budgets, taus, "o-", color="tab:green", label="DDTree acceptance length")
        if "linear" in modes:
            curve.axhline(modes["linear"]["acceptance_length"], color="tab:green", ls="--", label="linear acceptance")
        curve.set_xscale("log", base=2)
        curve.set_xlabel("tree budget (nodes)")
        curve.set_ylabel("acceptance length")
        if base:
            twin = curve.twinx()
            twin.plot(budgets, [modes[f"ddtree:{b}"]["tokens_per_s"] / base for b in budgets], "s-",
                      color="tab:blue", label="DDTree speed / plain")
            if "linear" in modes:
                twin.axhline(modes["linear"]["tokens_per_s"] / base, color="tab:blue", ls="--",
                             label="linear speed / plain")
            twin.set_ylabel("speed-up over our plain decoding")
            twin.legend(loc="lower right", fontsize=8)
        curve.legend(loc="upper left", fontsize=8)
        curve.set_title("tree budget", fontsize=9)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
