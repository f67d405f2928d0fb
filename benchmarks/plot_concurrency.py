"""Plot of a `dflash bench concurrency` result: aggregate tokens/s against concurrent clients per mode (with the
same requests one after another, dashed, when the run measured them), and p50/p95 latency per mode.

    python benchmarks/plot_concurrency.py results/concurrency.json --out results/concurrency.png
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
    parser.add_argument("result", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    result = json.loads(args.result.read_text())
    fig, (speed, latency) = plt.subplots(1, 2, figsize=(12, 4.5))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for index, (mode, rows) in enumerate(result["modes"].items()):
        colour = colours[index % len(colours)]
        levels = [row["concurrency"] for row in rows]
        speed.plot(levels, [row["tokens_per_s"] for row in rows], "o-", color=colour, label=mode)
        if all("sequential_tokens_per_s" in row for row in rows):
            speed.plot(levels, [row["sequential_tokens_per_s"] for row in rows], "x--", color=colour,
                       label=f"{mode}, one after another")
        latency.plot(levels, [row["latency_s"]["p50"] for row in rows], "o-", color=colour, label=f"{mode} p50")
        latency.plot(levels, [row["latency_s"]["p95"] for row in rows], "^:", color=colour, label=f"{mode} p95")
    batching = f"max_batch {result['max_batch']}" if result["batched"] else "one request at a time"
    speed.set_title(f"{result['model']} on {result['device']}\n{result['max_tokens']} tokens per request, "
                    f"{result['dtype']}, {batching}", fontsize=9)
    speed.set_ylabel("aggregate tokens/s")
    latency.set_title("end-to-end latency per request", fontsize=9)
    latency.set_ylabel("seconds")
    for axis in (speed, latency):
        axis.set_xscale("log", base=2)
        axis.set_xticks(result["levels"], [str(level) for level in result["levels"]])
        axis.set_xlabel("concurrent clients")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=130)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
