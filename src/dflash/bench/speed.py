"""Decoding speed of every mode on the same prompts, device and model, in one run, after warm-up.

Modes: `transformers` (HF generate, greedy), `transformers-pld` (its prompt-lookup decoding), `ar` (our plain
decoding), `linear` (DFlash), `ddtree` (at the engine's budget) or `ddtree:N` (budget N); any of ours with the
suffix `@eager` runs without the GPU fast path (for its gain in the same run). Tokens/s is completion tokens over
wall time (prefill included), aggregated over the prompt set; the median over `runs` repetitions is reported with
ratios between modes. The repetitions are interleaved (every mode's first, then every mode's second, ...), so that a
drift of the machine's speed during the run does not favour one mode.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from dflash.bench.provenance import provenance
from dflash.engine.engine import Engine
from dflash.fastpath.dispatch import graph_runner_of
from dflash.generation.forwards import forwards_for, register_forwards
from dflash.generation.request import GenerationRequest
from dflash.models.int8_linear import uses_int8_weights
from dflash.models.quantized_layers import uses_quantized_weights
from dflash.progress import progress_bar
from dflash.training.prompts import read_prompt_file

Runner = Callable[[list[int]], tuple[int, float]]  # prompt ids -> (new tokens, acceptance length or 0)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _runner(engine: Engine, mode: str, model_arg: str, max_tokens: int) -> Runner:
    if mode.startswith("transformers"):
        from dflash.bench.baselines import load_transformers_model, transformers_generate

        hf = load_transformers_model(model_arg, engine.device, engine.target.embed_tokens.weight.dtype)
        lookup = mode == "transformers-pld"
        return lambda ids: (transformers_generate(hf, ids, max_tokens, engine.eos_ids, lookup), 0.0)
    name, _, variant = mode.partition("@")
    base, _, budget = name.partition(":")
    if base not in ("ar", "linear", "ddtree") or variant not in ("", "eager") or (budget and base != "ddtree"):
        raise ValueError(f"unknown speed mode {mode!r}")
    spec = {"ar": "none"}.get(base, base)

    def run(ids: list[int]) -> tuple[int, float]:
        with _variant(engine, int(budget) if budget else None, eager=variant == "eager"):
            result = engine.generate(GenerationRequest(prompt_ids=ids, max_new_tokens=max_tokens), spec=spec)
        return result.stats.completion_tokens, result.stats.acceptance_length

    return run


@contextmanager
def _variant(engine: Engine, budget: int | None, *, eager: bool) -> Iterator[None]:
    """Run with another tree budget and/or without the CUDA graph runner, then restore the engine."""
    saved_options = engine.options
    saved_forwards = forwards_for(engine.target)
    if budget is not None:
        engine.options = replace(saved_options, ddtree_budget=budget)
    if eager:
        register_forwards(engine.target, None)
    try:
        yield
    finally:
        engine.options = saved_options
        register_forwards(engine.target, saved_forwards)


def interleaved_runs(
    runners: dict[str, Runner],
    repeats: dict[str, int],
    prompts: list[list[int]],
    *,
    sync: Callable[[], None] = lambda: None,
    advance: Callable[[int], None] = lambda n: None,
) -> dict[str, dict[str, Any]]:
    """Time `repeats[mode]` passes of every runner over the prompts, repetition r of every mode before repetition
    r + 1 of any: a machine whose speed drifts during the run (clocks, neighbours) then weighs on every mode alike
    instead of on the modes that happen to run last. Per mode: median tokens/s, tokens of a pass, every pass's
    tokens/s, mean acceptance length (None without speculation)."""
    per_run: dict[str, list[float]] = {mode: [] for mode in runners}
    tokens: dict[str, int] = {}
    acceptance: dict[str, list[float]] = {mode: [] for mode in runners}
    for repetition in range(max(repeats.values(), default=0)):
        for mode, runner in runners.items():
            if repetition >= repeats[mode]:
                continue
            produced, seconds = 0, 0.0
            for ids in prompts:
                sync()
                started = time.perf_counter()
                new, tau = runner(ids)
                sync()
                seconds += time.perf_counter() - started
                produced += new
                if tau:
                    acceptance[mode].append(tau)
                advance(1)
            per_run[mode].append(produced / seconds)
            tokens[mode] = produced
    return {
        mode: {
            "tokens_per_s": round(statistics.median(per_run[mode]), 3),
            "tokens_per_run": tokens[mode],
            "runs": per_run[mode],
            "acceptance_length": round(statistics.fmean(acceptance[mode]), 4) if acceptance[mode] else None,
        }
        for mode in runners
        if per_run[mode]
    }


def measure_speed(
    engine: Engine,
    prompt_files: list[Path],
    *,
    modes: list[str],
    limit: int,
    max_tokens: int,
    runs: int,
    model_arg: str,
    baseline_runs: int | None = None,
) -> dict[str, Any]:
    """`runs` repetitions per mode (median reported); the transformers modes take `baseline_runs` instead when given
    (they run 30-40x slower, so their repetitions dominate a run's time)."""
    prompts = [engine.chat_prompt_ids(chat) for path in prompt_files for chat in read_prompt_file(path)[:limit]]
    runners = {mode: _runner(engine, mode, model_arg, max_tokens) for mode in modes}
    repeats = {
        mode: baseline_runs if baseline_runs is not None and mode.startswith("transformers") else runs for mode in modes
    }
    for mode, runner in runners.items():
        # warm-up: a whole first generation (kernel choices, allocator, clocks); our modes run every prompt once,
        # so each graph shape they need is captured before timing, as a serving engine's first requests do
        for ids in prompts if not mode.startswith("transformers") else prompts[:1]:
            runner(ids)
    with progress_bar("speed", sum(repeats.values()) * len(prompts)) as bar:
        results = interleaved_runs(runners, repeats, prompts, sync=lambda: _sync(engine.device), advance=bar.advance)
    ratios: dict[str, float] = {}
    for base in ("ar", "transformers"):
        if base in results:
            for mode, value in results.items():
                if mode != base:
                    ratios[f"{mode}/{base}"] = round(value["tokens_per_s"] / results[base]["tokens_per_s"], 3)
    return {
        **provenance(engine.device),
        "dtype": str(engine.target.embed_tokens.weight.dtype).removeprefix("torch."),
        "weights": "quantized" if uses_quantized_weights(engine.target) else "dense",
        "cpu_matmul": engine.cpu_matmul,
        "threads": torch.get_num_threads(),
        "model": engine.model_name,
        "drafter": engine.drafter is not None,
        "draft_weights": None if engine.drafter is None else (
            "quantized" if uses_quantized_weights(engine.drafter) else "int8" if uses_int8_weights(engine.drafter)
            else "dense"
        ),
        "ddtree_budget": engine.options.ddtree_budget,
        "cuda_graphs": graph_runner_of(engine.target) is not None,
        "num_drafts": engine.options.num_drafts,
        "prompts": len(prompts),
        "prompt_files": [str(p) for p in prompt_files],
        "max_tokens": max_tokens,
        "modes": results,
        "ratios": ratios,
    }


def format_speed_table(result: dict[str, Any]) -> str:
    products = f", {result['cpu_matmul']} products" if result.get("cpu_matmul") else ""
    lines = [f"{result['model']} ({result['weights']} weights{products}) on {result['device']}, "
             f"{result['prompts']} prompts x {result['max_tokens']} tokens"]
    lines.append(f"{'mode':<18}{'tokens/s':>10}{'acceptance':>12}")
    for mode, r in result["modes"].items():
        tau = f"{r['acceptance_length']:.2f}" if r["acceptance_length"] else "-"
        lines.append(f"{mode:<18}{r['tokens_per_s']:>10.2f}{tau:>12}")
    for name, value in result["ratios"].items():
        lines.append(f"{name}: {value:.2f}x")
    return "\n".join(lines)
