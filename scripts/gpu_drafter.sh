#!/usr/bin/env bash
# Reproduces the shipped drafter of the default model on one GPU, in phases that each fit a 10-minute slot.
#   scripts/gpu_drafter.sh stage            # join the staged GGUF parts (PARTS of them, default 4) and check it
#   scripts/gpu_drafter.sh data MINUTES     # the target answers the training prompts
#   scripts/gpu_drafter.sh fit MINUTES      # train (resumes from $RUN/checkpoint.pt)
#   scripts/gpu_drafter.sh export DIR       # published layout, bf16, 15 MiB shards
#   scripts/gpu_drafter.sh eval DIR         # acceptance on the three evaluation sets (real decoding loop)
#   scripts/gpu_drafter.sh replay DIR       # the same figure by exact batched replay (fast)
# Settings from the environment: PROMPTS (prompt files, space-separated; .stage/train_prompts.jsonl.gz), DATA_BATCH (512), DATA (answered sets,
# space-separated; $RUN/data.jsonl.gz), STEPS (5000), BATCH (32), ANCHORS (48 blocks per sequence), LR (6e-4), DISTILL (0: hard labels only),
# LAYERS (4), MLP (the target's width), INIT (a drafter or a run folder to continue from, grown to LAYERS / MLP).
# ARCH=dflash2 trains a DFlash2 drafter (block convolutions + candidate selector; docs/dflash2.md): BLOCK (8 for
# dflash2, 16 for dflash), SELECTOR_RANK (256), SELECTOR_WEIGHT (1.0, the selector loss's weight); with INIT=default
# it starts from the shipped DFlash drafter's weights, e.g.
#   ARCH=dflash2 INIT=default RUN=/tmp/run2 DATA="/tmp/run/data.jsonl.gz" scripts/gpu_drafter.sh fit 9
# Dependencies a bare GPU machine lacks (gguf, platformdirs): their wheels in .stage/wheels (or $WHEELS), see scripts/gpu_env.sh.
set -euo pipefail
STAGE=${STAGE:-/tmp/m}
RUN=${RUN:-/tmp/run}
DATA=${DATA:-$RUN/data.jsonl.gz}
# another target: MODEL (its staged path) and SHA (the whole file's sha256), e.g. Gemma-3-270M (docs in its drafter's README)
MODEL=${MODEL:-$STAGE/SmolLM2-135M-Instruct.Q4_1.gguf}
SHA=${SHA:-b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53}
DFLASH="python3 -m dflash"
. scripts/gpu_env.sh
mkdir -p "$STAGE" "$RUN"
case "$1" in
  stage)
    if [ -f "$MODEL" ] && echo "$SHA  $MODEL" | sha256sum -c --quiet; then echo "model staged"; exit 0; fi
    for part in .stage/p*/gguf.part*; do [ -f "$part" ] && cp "$part" "$STAGE/"; done
    missing=0
    for i in $(seq 0 $((${PARTS:-4} - 1))); do [ -f "$STAGE/gguf.part0$i" ] || missing=1; done
    if [ "$missing" = 0 ]; then
      cat "$STAGE"/gguf.part0* > "$MODEL" && echo "$SHA  $MODEL" | sha256sum -c
    else
      ls -la "$STAGE"
      echo "model not staged yet: parts missing" >&2
      exit 1
    fi ;;
  data)
    sets=()
    for file in ${PROMPTS:-.stage/train_prompts.jsonl.gz}; do sets+=(--prompts "$file"); done
    $DFLASH train data --model "$MODEL" "${sets[@]}" --out "$DATA" \
      --batch-size "${DATA_BATCH:-512}" --max-new-tokens 256 --max-prompt-tokens 512 --max-minutes "$2" ;;
  fit)
    extra=()
    for set in $DATA; do extra+=(--data "$set"); done
    [ -n "${MLP:-}" ] && extra+=(--intermediate-size "$MLP")
    [ -n "${INIT:-}" ] && extra+=(--init-from "$INIT")
    arch=${ARCH:-dflash}
    block=${BLOCK:-16}
    if [ "$arch" = dflash2 ]; then
      block=${BLOCK:-8}
      extra+=(--selector-rank "${SELECTOR_RANK:-256}" --selector-loss-weight "${SELECTOR_WEIGHT:-1.0}")
    fi
    $DFLASH train fit --model "$MODEL" --arch "$arch" "${extra[@]}" --out "$RUN" --layers "${LAYERS:-4}" --block-size "$block" \
      --steps "${STEPS:-5000}" --batch-size "${BATCH:-32}" --max-length 768 --anchors "${ANCHORS:-48}" --lr "${LR:-6e-4}" \
      --distill "${DISTILL:-0}" --max-minutes "$2" ;;
  export)
    $DFLASH train export --run "$RUN" --out "$2" ;;
  eval)
    $DFLASH bench acceptance --model "$MODEL" --draft "$2" --spec linear --max-tokens 256 \
      --prompts-file benchmarks/prompts/humaneval.jsonl --prompts-file benchmarks/prompts/mtbench.jsonl \
      --prompts-file benchmarks/prompts/sharegpt_heldout.jsonl --json --out "$2/../acceptance_gpu.json" ;;
  replay)
    $DFLASH train eval --model "$MODEL" --draft "$2" --max-tokens 256 --batch-size 512 \
      --prompts-file benchmarks/prompts/humaneval.jsonl --prompts-file benchmarks/prompts/mtbench.jsonl \
      --prompts-file benchmarks/prompts/sharegpt_heldout.jsonl --out "$2/../replay_gpu.json" ;;
  *) echo "unknown phase $1" >&2; exit 2 ;;
esac
