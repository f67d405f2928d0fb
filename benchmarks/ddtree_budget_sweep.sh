#!/bin/sh
# DDTree acceptance length and speed per budget against our plain decoding, one run per budget (same prompts).
#   benchmarks/ddtree_budget_sweep.sh [LIMIT] [MAX_TOKENS]   -> results/ddtree_budget_B.json, then the plot
set -e
LIMIT=${1:-2}
TOKENS=${2:-128}
for b in 4 8 16 32 64; do
  .venv/bin/dflash bench speed --modes ar,linear,ddtree --ddtree-budget $b --limit "$LIMIT" --max-tokens "$TOKENS" \
    --json --out results/ddtree_budget_$b.json > /dev/null
done
.venv/bin/python benchmarks/plot_ddtree_sweep.py results/ddtree_budget_*.json --out results/ddtree_budgets_cpu.png
