"""Plot time to first token against prompt length, cold (no prefix cache) and warm, from one or more
`dflash bench agent-loop` results (repeated runs show the machine's noise); a second panel shows the warm/cold
ratio against the 20% bar."""

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
    parser.add_argument("--title", default=None)
    args = parser.parse_args()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    model, calls = "model", 0
    for run, path in enumerate(args.results, 1):
        result = json.loads(path.read_text())
        model = result["servers"]["warm"]["model"].get("id", model)
        rows = [r for r in result["calls"] if r["prompt_tokens"] and r["cold"]["ttft_s"] and r["warm"]["ttft_s"]]
        calls = len(rows)
        tokens = [r["prompt_tokens"] for r in rows]
        tag = f" (run {run})" if len(args.results) > 1 else ""
        style = "-" if run == 1 else "--"
        left.plot(tokens, [r["cold"]["ttft_s"] for r in rows], "o" + style, color="tab:blue", label="cold" + tag)
        left.plot(tokens, [r["warm"]["ttft_s"] for r in rows], "s" + style, color="tab:orange", label="warm" + tag)
        right.plot(tokens[1:], [r["ttft_ratio"] for r in rows[1:]], "s" + style, color="tab:green",
                   label="warm / cold" + tag)
    left.set_xlabel("prompt tokens")
    left.set_ylabel("time to first token (s)")
    left.legend()
    left.grid(alpha=0.3)
    right.axhline(0.2, color="tab:red", linewidth=0.8, linestyle="--", label="20% bar")
    right.set_xlabel("prompt tokens")
    right.set_ylabel("time to first token, warm / cold")
    right.set_ylim(bottom=0)
    right.legend()
    right.grid(alpha=0.3)
    fig.suptitle(args.title or f"{model}: agent-loop replay, {calls} calls; cold = --prefix-cache-mb 0, "
                 "warm = default (its first call is a miss)")
    fig.tight_layout()
    fig.savefig(args.out, dpi=100)


if __name__ == "__main__":
    main()
