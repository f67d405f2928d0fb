"""Acceptance of a drafter on examples it was trained on: tells memorisation from under-training.

Exact replay of greedy linear rounds (as `dflash train eval`) over a random sample of an answered training set,
plus the mean over every anchor and split by whether the round before it was rejected at its first draft.

    python benchmarks/replay_on_training_data.py --draft DIR --data data.jsonl.gz --limit 40 --out result.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from pathlib import Path

import torch

from dflash.bench.provenance import provenance
from dflash.drafter.loader import load_drafter
from dflash.models.registry import build_model
from dflash.models.resolve import load_checkpoint
from dflash.training.datagen import read_examples
from dflash.training.replay import anchor_draft_logits, linear_rounds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--draft", required=True)
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--limit", type=int, default=40)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    checkpoint = load_checkpoint("default")
    target = build_model(checkpoint.config, checkpoint.weights, device=torch.device("cpu"), dtype=torch.float32)
    drafter = load_drafter(args.draft, target.config)
    examples = list(read_examples(args.data))
    sample = random.Random(args.seed).sample(examples, args.limit)
    replayed, every_anchor, after_miss, after_hit = [], [], [], []
    for prompt, answer in sample:
        answer = answer[: args.max_tokens]
        if len(answer) < 4:
            continue
        logits, labels = anchor_draft_logits(target, drafter, prompt, answer)  # [anchors, B-1, vocab], [anchors, B-1]
        correct = (logits.argmax(-1) == labels) & (labels >= 0)
        runs = (correct.long().cumprod(-1).sum(-1) + 1).tolist()  # acceptance length of a round at each anchor
        replayed.append(linear_rounds(logits, labels, len(answer)).mean)
        every_anchor += runs
        first_hit = correct[:, 0].tolist()
        for i in range(1, len(runs)):
            (after_hit if first_hit[i - 1] else after_miss).append(runs[i])
    result = {
        **provenance(torch.device("cpu")),
        "draft": args.draft,
        "data": str(args.data),
        "examples": len(replayed),
        "replay_acceptance_length": round(statistics.fmean(replayed), 4),
        "every_anchor_acceptance_length": round(statistics.fmean(every_anchor), 4),
        "after_first_draft_rejected": round(statistics.fmean(after_miss), 4),
        "after_first_draft_accepted": round(statistics.fmean(after_hit), 4),
    }
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
