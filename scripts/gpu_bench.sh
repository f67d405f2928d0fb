#!/usr/bin/env bash
# GPU benchmarks, in phases that each fit a 10-minute slot (results land in OUT, default $OUT or ./gpu_out).
#   scripts/gpu_bench.sh stage      # join the staged GGUF parts of the default model (scripts/gpu_drafter.sh stage)
#   scripts/gpu_bench.sh tests      # the GPU tests
#   scripts/gpu_bench.sh table      # speed table: transformers generate() and prompt lookup, our AR, linear, DDTree
#                                     (12 + 12 prompts; our modes median of 3 runs, the transformers modes one run:
#                                     they take ~5 of the 10 minutes)
#   scripts/gpu_bench.sh sweep      # DDTree budgets 4..64 beside linear and plain, graphs and eager plain decoding
#   scripts/gpu_bench.sh replay     # acceptance per tree budget on the three evaluation sets (exact replay)
#   scripts/gpu_bench.sh scale      # the random-weight Qwen3-8B-shaped scale study
#   scripts/gpu_bench.sh batch-tests  # the batched core's GPU tests (device rounds, graphs, context writes)
#   scripts/gpu_bench.sh concurrency  # plain, linear and DDTree under 8, 16 and 32 clients, twice each, greedy
#                                     (TEMPERATURE=1: sampled, request i seeded with i; SPREAD=0.5: request i's
#                                     length drawn from i in [128, 384], `--length-spread`)
#   scripts/gpu_bench.sh trace        # where the engine loop's time goes at 32 clients, host phases and GPU passes
#                                     (`benchmarks/engine_loop_trace.py`; MODES, LEVELS, TEMPERATURE as above)
set -euo pipefail
STAGE=${STAGE:-/tmp/m}
MODEL=$STAGE/SmolLM2-135M-Instruct.Q4_1.gguf
RESULTS=${OUT:-$PWD/gpu_out}
DFLASH="python3 -m dflash"
SETS="--prompts-file benchmarks/prompts/humaneval.jsonl --prompts-file benchmarks/prompts/mtbench.jsonl"
. scripts/gpu_env.sh
mkdir -p "$RESULTS"
case "$1" in
  stage)
    scripts/gpu_drafter.sh stage ;;
  tests)
    python3 -m pytest -q -m gpu tests/test_fastpath.py ;;
  table)
    $DFLASH bench speed --model "$MODEL" --draft default --device cuda $SETS --limit "${LIMIT:-12}" \
      --max-tokens 256 --runs "${RUNS:-3}" --baseline-runs "${BASELINE_RUNS:-1}" \
      --modes transformers,transformers-pld,ar,linear,ddtree --json --out "$RESULTS/gpu_speed_table.json" ;;
  sweep)
    $DFLASH bench speed --model "$MODEL" --draft default --device cuda $SETS --limit "${LIMIT:-4}" \
      --max-tokens 256 --runs "${RUNS:-3}" \
      --modes ar,ar@eager,linear,linear@eager,ddtree:4,ddtree:8,ddtree:16,ddtree:32,ddtree:64 \
      --json --out "$RESULTS/gpu_ddtree_sweep.json" ;;
  replay)
    $DFLASH train eval --model "$MODEL" --draft default --max-tokens 256 --batch-size 512 \
      --ddtree-budgets 4,8,16,32,64 $SETS --prompts-file benchmarks/prompts/sharegpt_heldout.jsonl \
      --out "$RESULTS/gpu_ddtree_replay.json" ;;
  scale)
    python3 benchmarks/gpu_scale_study.py --out "$RESULTS/gpu_scale_study.json" ;;
  batch-tests)
    python3 -m pytest -q -m gpu tests/test_context_store.py tests/test_batch_device_trees.py tests/test_batch_gpu.py \
      tests/test_graph_capture_threads.py tests/test_batched_step.py tests/test_batch_alone.py ;;
  concurrency)
    $DFLASH bench concurrency --model "$MODEL" --draft default --device cuda --modes "${MODES:-ar,linear,ddtree}" \
      --concurrency "${LEVELS:-8,16,32,8,16,32}" --max-batch 32 --requests 128 --max-tokens 256 \
      --warmup-requests 16 --temperature "${TEMPERATURE:-0}" --length-spread "${SPREAD:-0}" --json \
      --out "$RESULTS/gpu_concurrency_t${TEMPERATURE:-0}${SPREAD:+_spread$SPREAD}.json" ;;
  trace)
    PYTHONPATH=$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH} python3 benchmarks/engine_loop_trace.py \
      "$RESULTS/gpu_engine_trace_t${TEMPERATURE:-0}.json" -- --model "$MODEL" --draft default --device cuda \
      --modes "${MODES:-ar,linear,ddtree}" --concurrency "${LEVELS:-32,32}" --max-batch 32 --requests 128 \
      --max-tokens 256 --warmup-requests 16 --temperature "${TEMPERATURE:-0}" --length-spread "${SPREAD:-0}" --json ;;
  *) echo "unknown phase $1" >&2; exit 2 ;;
esac
