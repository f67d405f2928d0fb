"""Decoding speed of every mode on the same prompts, device and model, in one run, after warm-up.

Modes: `transformers` (HF generate, greedy), `transformers-pld` (its prompt-lookup decoding), `ar` (our plain
decoding), `linear` (DFlash), `ddtree` (at the engine's budget) or `ddtree:N` (budget N); any of ours with the
suffix `@eager` runs without the GPU fast path (for its gain in the same run); `llama.cpp`: llama.cpp's
`llama-bench` on the engine's own GGUF file with the run's threads, lengths and repetitions
(`dflash.bench.llama_cpp_peer`).

Figures per mode (the median over `runs` repetitions, aggregated over the prompt set):
- `tokens_per_s`: completion tokens over wall time, prefill included; ratios between modes compare it.
- `decode_tokens_per_s`: the tokens the decoding steps produced over the decode seconds (`GenerationStats.decode_s`,
  which start after the prefill). The first token comes from the prefill's logits, so it is not counted there.
- `prefill_tokens_per_s`: prompt tokens prefilled over prefill seconds.
llama-bench's `tg` test is pure decode (tokens generated one at a time from an empty context, no prompt) and its
`pp` test a prompt processed in one batch: the `llama.cpp` row's `tokens_per_s` and `decode_tokens_per_s` are both
its tg figure and its `prefill_tokens_per_s` its pp figure; `timed` says which clock a row's `tokens_per_s` is. The
ratios `MODE/llama.cpp` compare decode with decode (our `decode_tokens_per_s` over llama-bench's tg), like for like.
`peak_rss_mib` is the resident memory high-water mark of this process (every mode, transformers models included)
and of the llama-bench process.

The repetitions are interleaved (every mode's first, then every mode's second, ...), so that a drift of the
machine's speed during the run does not favour one mode; llama-bench runs its repetitions in one process before ours.
"""

from __future__ import annotations

import resource
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from dflash.bench.llama_cpp_peer import (
    LLAMA_CPP_MODE,
    LlamaBenchPeer,
    LlamaBenchRun,
    maxrss_mib,
    mean_prompt_tokens,
    prepare_peer,
    run_llama_bench,
)
from dflash.bench.provenance import provenance
from dflash.bench.speed_report import WALL, llama_cpp_row, speed_ratios
from dflash.engine.engine import Engine
from dflash.fastpath.dispatch import graph_runner_of
from dflash.generation.forwards import forwards_for, register_forwards
from dflash.generation.request import GenerationRequest
from dflash.models.int8_linear import uses_int8_weights
from dflash.models.quantized_layers import uses_quantized_weights
from dflash.progress import progress_bar
from dflash.training.prompts import read_prompt_file


@dataclass(frozen=True)
class RunOutcome:
    """One generation as the speed bench counts it; the timings are zero where a mode does not split them
    (transformers)."""

    completion_tokens: int
    acceptance_length: float = 0.0  # 0: no speculation
    prefilled_tokens: int = 0  # prompt tokens run through the target (not restored from a prefix cache)
    prefill_s: float = 0.0
    decode_s: float = 0.0  # from the end of the prefill to the last token

    @property
    def decoded_tokens(self) -> int:
        """Tokens the decoding steps produced: the first comes from the prefill's logits."""
        return max(self.completion_tokens - 1, 0)


Runner = Callable[[list[int]], RunOutcome]  # prompt ids -> what the generation produced and how long its parts took


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _runner(engine: Engine, mode: str, model_arg: str, max_tokens: int) -> Runner:
    if mode.startswith("transformers"):
        from dflash.bench.baselines import load_transformers_model, transformers_generate

        hf = load_transformers_model(model_arg, engine.device, engine.target.embed_tokens.weight.dtype)
        lookup = mode == "transformers-pld"
        return lambda ids: RunOutcome(transformers_generate(hf, ids, max_tokens, engine.eos_ids, lookup))
    name, _, variant = mode.partition("@")
    base, _, budget = name.partition(":")
    if base not in ("ar", "linear", "ddtree") or variant not in ("", "eager") or (budget and base != "ddtree"):
        raise ValueError(f"unknown speed mode {mode!r}")
    spec = {"ar": "none"}.get(base, base)

    def run(ids: list[int]) -> RunOutcome:
        with _variant(engine, int(budget) if budget else None, eager=variant == "eager"):
            result = engine.generate(GenerationRequest(prompt_ids=ids, max_new_tokens=max_tokens), spec=spec)
        stats = result.stats
        return RunOutcome(
            stats.completion_tokens, stats.acceptance_length,
            prefilled_tokens=stats.prompt_tokens - stats.cached_tokens, prefill_s=stats.prefill_s,
            decode_s=stats.decode_s,
        )

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
    instead of on the modes that happen to run last. Per mode: median tokens/s (wall), tokens of a pass, every pass's
    tokens/s, mean acceptance length (None without speculation), median decode-only and prefill tokens/s (None where
    the runner does not time them)."""
    per_run: dict[str, list[float]] = {mode: [] for mode in runners}
    decode_per_run: dict[str, list[float]] = {mode: [] for mode in runners}
    prefill_per_run: dict[str, list[float]] = {mode: [] for mode in runners}
    tokens: dict[str, int] = {}
    acceptance: dict[str, list[float]] = {mode: [] for mode in runners}
    for repetition in range(max(repeats.values(), default=0)):
        for mode, runner in runners.items():
            if repetition >= repeats[mode]:
                continue
            produced, seconds = 0, 0.0
            decoded, decode_s, prefilled, prefill_s = 0, 0.0, 0, 0.0
            for ids in prompts:
                sync()
                started = time.perf_counter()
                outcome = runner(ids)
                sync()
                seconds += time.perf_counter() - started
                produced += outcome.completion_tokens
                decoded, decode_s = decoded + outcome.decoded_tokens, decode_s + outcome.decode_s
                prefilled, prefill_s = prefilled + outcome.prefilled_tokens, prefill_s + outcome.prefill_s
                if outcome.acceptance_length:
                    acceptance[mode].append(outcome.acceptance_length)
                advance(1)
            per_run[mode].append(produced / seconds)
            if decode_s > 0:
                decode_per_run[mode].append(decoded / decode_s)
            if prefill_s > 0:
                prefill_per_run[mode].append(prefilled / prefill_s)
            tokens[mode] = produced
    return {
        mode: {
            "tokens_per_s": round(statistics.median(per_run[mode]), 3),
            "tokens_per_run": tokens[mode],
            "runs": per_run[mode],
            "acceptance_length": round(statistics.fmean(acceptance[mode]), 4) if acceptance[mode] else None,
            "timed": WALL,
            "decode_tokens_per_s": _median(decode_per_run[mode]),
            "prefill_tokens_per_s": _median(prefill_per_run[mode]),
        }
        for mode in runners
        if per_run[mode]
    }


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 3) if values else None


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
    llama_bench: LlamaBenchPeer | None = None,
) -> dict[str, Any]:
    """`runs` repetitions per mode (median reported); the transformers modes take `baseline_runs` instead when given
    (they run 30-40x slower, so their repetitions dominate a run's time). The `llama.cpp` mode runs `llama_bench`
    (default: found from `model_arg` and the environment, `llama_cpp_peer.prepare_peer`) before our modes, with this
    process's torch thread count."""
    ours = [mode for mode in modes if mode != LLAMA_CPP_MODE]
    prompts = [engine.prompt_set_ids(chat) for path in prompt_files for chat in read_prompt_file(path)[:limit]]
    llama_cpp: dict[str, Any] | None = None
    if LLAMA_CPP_MODE in modes:  # first: a failing peer then costs none of our runs
        llama_cpp = run_llama_bench(LlamaBenchRun(
            llama_bench or prepare_peer(model_arg), threads=torch.get_num_threads(),
            prompt_tokens=mean_prompt_tokens(prompts), gen_tokens=max_tokens, repetitions=runs,
            gpu=engine.device.type == "cuda",
        ))
    runners = {mode: _runner(engine, mode, model_arg, max_tokens) for mode in ours}
    repeats = {
        mode: baseline_runs if baseline_runs is not None and mode.startswith("transformers") else runs for mode in ours
    }
    for mode, runner in runners.items():
        # warm-up: a whole first generation (kernel choices, allocator, clocks); our modes run every prompt once,
        # so each graph shape they need is captured before timing, as a serving engine's first requests do
        for ids in prompts if not mode.startswith("transformers") else prompts[:1]:
            runner(ids)
    with progress_bar("speed", sum(repeats.values()) * len(prompts)) as bar:
        results = interleaved_runs(runners, repeats, prompts, sync=lambda: _sync(engine.device), advance=bar.advance)
    peak_rss: dict[str, float] = {"ours": round(maxrss_mib(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss), 1)}
    if llama_cpp is not None:
        results[LLAMA_CPP_MODE] = llama_cpp_row(llama_cpp)
        results = {mode: results[mode] for mode in modes if mode in results}  # in the order asked
        peak_rss[LLAMA_CPP_MODE] = llama_cpp["peak_rss_mib"]
        peak_rss[f"ours/{LLAMA_CPP_MODE}"] = round(peak_rss["ours"] / llama_cpp["peak_rss_mib"], 3)
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
        "ratios": speed_ratios(results),
        "peak_rss_mib": peak_rss,
        **({"llama_cpp": llama_cpp} if llama_cpp is not None else {}),
    }
