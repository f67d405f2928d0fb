"""Text the default drafter's token shortlist is counted on, as answered-data JSONL for `dflash train vocab`.

ShareGPT assistant turns (conversations whose index is not a multiple of 50: the held-out ones are skipped, as in
training) and the first 6,000 characters of 1,500 Python standard-library sources (seeded shuffle), tokenized with
the default model's tokenizer, each ending with its end-of-turn token as the target's answers do. A stand-in for the
target's own answers, which `dflash train data` produces on a GPU.

    python scripts/make_vocab_corpus.py --sharegpt ShareGPT_V3_unfiltered_cleaned_split.json --out corpus.jsonl.gz
    dflash train vocab --data corpus.jsonl.gz --size 8192 --out draft_vocab.safetensors
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import sysconfig
from pathlib import Path

from dflash.models.resolve import load_checkpoint
from dflash.training.prompts import iter_sharegpt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sharegpt", type=Path, required=True)
    parser.add_argument("--sources", type=int, default=1500, help="standard-library files")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    tokenizer = load_checkpoint("default", weights="quantized").tokenizer
    assert tokenizer is not None
    end_of_turn = tokenizer.token_to_id("<|im_end|>")
    texts = [
        message["content"][:4000]
        for index, messages in iter_sharegpt(args.sharegpt)
        if index % 50
        for message in messages
        if message["role"] == "assistant" and message["content"].strip()
    ]
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))
    random.Random(0).shuffle(files)
    for path in files[: args.sources]:
        try:
            texts.append(path.read_text(encoding="utf-8")[:6000])
        except (OSError, UnicodeDecodeError):
            continue
    with gzip.open(args.out, "wt", encoding="utf-8") as out:
        for text in texts:
            ids = [*tokenizer.encode(text), end_of_turn]
            out.write(json.dumps({"prompt_ids": [], "response_ids": ids}) + "\n")
    print(json.dumps({"examples": len(texts), "out": str(args.out)}))


if __name__ == "__main__":
    main()
