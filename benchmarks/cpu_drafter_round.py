"""The drafter's round on the CPU: dense float32 against Q8_0 blocks, and what a shorter block would cost.

Part 1 times `draft_scores` (4 and 15 drafted positions, best of 3 x 40 rounds after a 300-position context) and the
drafter's projections alone at 16 rows, for the shipped drafter dense and as Q8_0 blocks
(`dflash.drafter.quantize`), beside the quantized default target.
With `--draft-vocab FILE` (repeatable) it also times the Q8_0 drafter's 4-draft round scoring only a shortlist.
Part 2 (`--slots 16,8,5`) measures DDTree (budget 4) acceptance when the drafter runs only the first S slots of its
16-slot block (8 prompts, 128 tokens): the drafter was trained on whole blocks, so fewer slots change its drafts.

    python benchmarks/cpu_drafter_round.py --out results/cpu_drafter_round_drafter_v5.json
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from dflash.bench.provenance import provenance, write_result
from dflash.drafter.model import DFlashDrafter
from dflash.drafter.quantize import quantize_drafter
from dflash.drafter.vocab import DraftScores, read_draft_vocab
from dflash.engine.engine import EngineOptions
from dflash.engine.loading import LoadOptions, load_engine
from dflash.generation.request import GenerationRequest
from dflash.models.quantized_layers import QuantizedLinear
from dflash.training.prompts import read_prompt_file

PROMPTS = Path(__file__).parent / "prompts"


def best_ms(step: Callable[[], object], rounds: int = 40, repeats: int = 3) -> float:
    for _ in range(5):
        step()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(rounds):
            step()
        times.append((time.perf_counter() - started) / rounds * 1000)
    return round(min(times), 3)


def round_times(drafter: DFlashDrafter, target: Any) -> dict[str, float]:
    config = drafter.config
    cache = drafter.new_cache(2048)
    drafter.draft_scores(target, 5, 300, torch.randn(1, 300, config.feature_size), cache).full()  # context of 300
    new = torch.randn(1, 3, config.feature_size)  # 3 newly committed positions per round

    def one(drafts: int) -> None:
        drafter.draft_scores(target, 7, cache.length + 3, new, cache, num_drafts=drafts)
        cache.crop(cache.length - 3)

    projections = [m for m in drafter.layers.modules() if isinstance(m, (torch.nn.Linear, QuantizedLinear))]
    rows = torch.randn(16, config.hidden_size)
    wide = torch.randn(16, config.intermediate_size)

    def matrices() -> None:
        for module in projections:
            module(wide if module.in_features == config.intermediate_size else rows)

    return {"draft_scores_4_ms": best_ms(lambda: one(4)), "draft_scores_15_ms": best_ms(lambda: one(15)),
            "projections_16_rows_ms": best_ms(matrices)}


def slot_acceptance(engine: Any, slots: int) -> float:
    """Mean DDTree acceptance with the drafter's block cut to its first `slots` slots."""
    drafter = engine.drafter
    full = drafter.config.block_size

    def draft_scores(target: Any, pending: int, start: int, new_features: torch.Tensor, cache: Any, *,
                     window: int | None = None, num_drafts: int | None = None) -> DraftScores:
        block = torch.full((1, slots), drafter.config.mask_token_id, dtype=torch.long)
        block[0, 0] = pending
        positions = torch.arange(start, start + slots)[None]
        new_positions = torch.arange(cache.length, cache.length + new_features.shape[1])[None]
        hidden = drafter.draft_hidden(target.embed(block), positions, new_features, new_positions, cache, window=window)
        return drafter.project_scores(target, hidden[0, 1 : 1 + (num_drafts or full - 1)])

    drafter.draft_scores = draft_scores if slots < full else DFlashDrafter.draft_scores.__get__(drafter)
    chats = read_prompt_file(PROMPTS / "humaneval.jsonl")[:4] + read_prompt_file(PROMPTS / "mtbench.jsonl")[:4]
    taus = []
    for chat in chats:
        request = GenerationRequest(prompt_ids=engine.chat_prompt_ids(chat), max_new_tokens=128)
        taus.append(engine.generate(request, spec="ddtree").stats.acceptance_length)
    return round(statistics.fmean(taus), 4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--slots", default="16,8,5", help="block slots for part 2 (empty: skip it)")
    parser.add_argument("--draft-vocab", type=Path, action="append", default=[],
                        help="a token shortlist (repeatable): the Q8_0 drafter's 4-draft round scoring only its ids")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    engine = load_engine("default", None, options=EngineOptions(spec="ddtree", ddtree_budget=4),
                         loading=LoadOptions(device="cpu", draft_weights="dense", draft_vocab="off"))
    assert engine.drafter is not None
    quantized = copy.deepcopy(engine.drafter)
    quantize_drafter(quantized)
    result: dict[str, Any] = {**provenance(engine.device), "model": engine.model_name,
                              "dense": round_times(engine.drafter, engine.target),
                              "q8_0": round_times(quantized, engine.target)}
    shortlists: dict[str, float] = {}
    for path in args.draft_vocab:
        ids = read_draft_vocab(path, engine.target.config.vocab_size)
        quantized.use_draft_vocab(ids, engine.target)
        shortlists[f"{path.name} ({ids.numel()} ids)"] = round_times(quantized, engine.target)["draft_scores_4_ms"]
    quantized.use_draft_vocab(None, engine.target)
    result["q8_0_draft_scores_4_ms_with_shortlist"] = shortlists
    engine.drafter = quantized
    slots = [int(s) for s in args.slots.split(",") if s.strip()]
    result["ddtree_4_acceptance_by_block_slots"] = {str(s): slot_acceptance(engine, s) for s in slots}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
    write_result(result, args.out, indent=2)


if __name__ == "__main__":
    main()
