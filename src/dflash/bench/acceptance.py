"""Acceptance length of speculative decoding on prompt sets (greedy, fixed new-token budget).

The top-level `acceptance_length` is the mean over every prompt of that prompt's mean tokens per round;
per-set means and per-prompt details sit beside it, with the date, device, versions, model and command.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from dflash.bench.provenance import provenance
from dflash.engine.engine import Engine
from dflash.generation.request import GenerationRequest
from dflash.progress import progress_bar
from dflash.training.prompts import read_prompt_file


def measure_acceptance(
    engine: Engine,
    prompt_files: list[Path],
    *,
    max_tokens: int = 256,
    spec: str | None = None,
    limit: int | None = None,
) -> dict[str, Any]:
    per_prompt: list[dict[str, Any]] = []
    sets: dict[str, Any] = {}
    for path in prompt_files:
        chats = read_prompt_file(path)[:limit] if limit else read_prompt_file(path)
        name = path.name.split(".")[0]
        values: list[float] = []
        tokens = rounds = 0
        with progress_bar(f"acceptance {name}", len(chats)) as bar:
            for index, chat in enumerate(chats):
                request = GenerationRequest(prompt_ids=engine.prompt_set_ids(chat), max_new_tokens=max_tokens)
                result = engine.generate(request, spec=spec)
                s = result.stats
                values.append(s.acceptance_length)
                tokens += s.completion_tokens
                rounds += s.rounds
                per_prompt.append({
                    "set": name, "index": index, "acceptance_length": round(s.acceptance_length, 4),
                    "rounds": s.rounds, "completion_tokens": s.completion_tokens, "tokens_per_s": round(s.tokens_per_s, 2),
                })
                bar.advance(1, f"tau {statistics.fmean(values):.2f}")
        sets[name] = {
            "prompts": len(chats),
            "acceptance_length": round(statistics.fmean(values), 4) if values else 0.0,
            "completion_tokens": tokens,
            "rounds": rounds,
        }
    all_values = [p["acceptance_length"] for p in per_prompt]
    return {
        **provenance(engine.device),
        "model": engine.model_name,
        "dtype": str(engine.target.embed_tokens.weight.dtype).removeprefix("torch."),
        "acceptance_length": round(statistics.fmean(all_values), 4) if all_values else 0.0,
        "spec": spec or engine.options.spec,
        "max_tokens": max_tokens,
        "sets": sets,
        "per_prompt": per_prompt,
    }
