"""Training data answered by the target itself.

Prompts are rendered with the target's chat template (a base model without one takes them as completion
prompts: `prompt_ids`) and answered greedily by the target through our
engine (batched on the accelerator), so the drafter learns the target's own distribution. Output: gzipped
JSONL, one `{"prompt_ids": [...], "response_ids": [...]}` per line; the response ids form the assistant span.
Generation resumes where an earlier, interrupted run stopped (prompts are processed in a fixed order).
"""

from __future__ import annotations

import gzip
import json
import random
import time
from collections.abc import Iterator
from pathlib import Path

from dflash.generation.batched import BatchedDecoder, generate_batch
from dflash.models.model import CausalLM
from dflash.progress import progress_bar
from dflash.tokenizer import Tokenizer
from dflash.training.prompts import prompt_ids


def read_examples(path: Path) -> Iterator[tuple[list[int], list[int]]]:
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        for line in handle:
            try:
                item = json.loads(line)
            except json.JSONDecodeError:
                return  # a line cut off by an interrupted run
            yield item["prompt_ids"], item["response_ids"]


def generate_training_data(
    model: CausalLM,
    tokenizer: Tokenizer,
    prompts: list[str],
    out_path: Path,
    *,
    batch_size: int = 64,
    max_new_tokens: int = 256,
    max_prompt_tokens: int = 512,
    max_minutes: float | None = None,
    seed: int = 0,
    window: int = 4096,
) -> int:
    """Answer `prompts` (skipping those already in `out_path`); return the number of examples in the file."""
    encoded = []
    for prompt in prompts:
        ids = prompt_ids(tokenizer, [{"role": "user", "content": prompt}])
        if len(ids) <= max_prompt_tokens:
            encoded.append(ids)
    # a fixed shuffle, then length-sorted windows: batches share lengths (less padding) while a run cut short
    # by its time budget still covers a random sample of the prompts
    random.Random(seed).shuffle(encoded)
    encoded = [ids for lo in range(0, len(encoded), window) for ids in sorted(encoded[lo : lo + window], key=len)]
    done = sum(1 for _ in read_examples(out_path)) if out_path.exists() else 0
    out_path.parent.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + max_minutes * 60 if max_minutes else None
    eos = tokenizer.eos_token_ids
    decoder: BatchedDecoder | None = None  # one cache and one set of captured steps for every full batch
    with gzip.open(out_path, "at", encoding="utf-8") as handle, progress_bar("answering prompts", len(encoded)) as bar:
        bar.advance(done)
        for lo in range(done, len(encoded), batch_size):
            if deadline is not None and time.monotonic() > deadline:
                break
            batch = encoded[lo : lo + batch_size]
            if decoder is None or not decoder.fits(len(batch), max_prompt_tokens + max_new_tokens):
                decoder = None  # the last, smaller batch: free the full batch's cache first
                decoder = BatchedDecoder(model, len(batch), max_prompt_tokens + max_new_tokens)
            answers = generate_batch(model, batch, max_new_tokens=max_new_tokens, eos_ids=eos, decoder=decoder)
            for asked, response_ids in zip(batch, answers, strict=True):
                handle.write(json.dumps({"prompt_ids": asked, "response_ids": response_ids}) + "\n")
            handle.flush()
            done += len(batch)
            bar.advance(len(batch))
    return done
