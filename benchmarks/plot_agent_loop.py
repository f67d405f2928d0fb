"""Plot time to first token against prompt length, cold (no prefix cache) and warm, from `dflash bench agent-loop`
results; a second panel shows the warm/cold ratio against the 20% bar."""

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
    parser.add_argument("--title", default=None)
    args = parser.parse_args()
    result = json.loads(args.result.read_text())
    rows = [r for r in result["calls"] if r["prompt_tokens"] and r["cold"]["ttft_s"] and r["warm"]["ttft_s"]]
    tokens = [r["prompt_tokens"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.plot(tokens, [r["cold"]["ttft_s"] for r in rows], "o-", label="cold (--prefix-cache-mb 0)")
    left.plot(tokens, [r["warm"]["ttft_s"] for r in rows], "s-", label="warm (prefix cache on)")
    left.set_xlabel("prompt tokens")
    left.set_ylabel("time to first token (s)")
    left.legend()
    left.grid(alpha=0.3)
    right.plot(tokens[1:], [r["ttft_ratio"] for r in rows[1:]], "s-", color="tab:green", label="warm / cold")
    right.axhline(0.2, color="tab:red", linewidth=0.8, linestyle="--", label="20% bar")
    right.set_xlabel("prompt tokens")
    right.set_ylabel("time to first token, warm / cold")
    right.set_ylim(0, max(0.5, *[r["ttft_ratio"] for r in rows[1:]]))
    right.legend()
    right.grid(alpha=0.3)
    model = result["servers"]["warm"]["model"].get("id", "model")
    fig.suptitle(args.title or f"{model}: agent-loop replay, {len(rows)} calls (first call of the warm run is a miss)")
    fig.tight_layout()
    fig.savefig(args.out, dpi=100)


if __name__ == "__main__":
    main()
