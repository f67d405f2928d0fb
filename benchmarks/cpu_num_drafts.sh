#!/bin/sh
# Speed of linear DFlash against our plain decoding on the CPU for several drafts-per-round settings.
set -e
for k in ${KS:-1 3 7 15}; do
  .venv/bin/dflash bench speed --modes ar,linear --num-drafts $k --limit 3 --max-tokens 128 \
    --prompts-file benchmarks/prompts/humaneval.jsonl --prompts-file benchmarks/prompts/mtbench.jsonl \
    --json --out results/cpu_num_drafts_$k.json | python3 -c "import json,sys; r=json.loads(sys.stdin.read()); print($k, r['modes']['ar']['tokens_per_s'], r['modes']['linear']['tokens_per_s'], r['modes']['linear']['acceptance_length'], r['ratios'])"
done
