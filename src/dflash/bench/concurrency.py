"""Aggregate throughput and latency of one engine under N concurrent requests (`dflash bench concurrency`).

Each (mode, level) runs a closed loop of `level` clients: `level` threads share the level's requests and each issues
its next request as soon as its previous one ends, so `level` requests stay in flight until the queue drains. Every
request is greedy (or sampled at `--temperature`, request i with seed i, the same in every mode and level) with
`ignore_eos=True`: it produces exactly its length whatever the model would answer, so request i does the same decoding
work in every mode and level, and tokens/s compare across them. Its length is `max_tokens`, or with a length spread
R an integer in [max_tokens (1 - R), max_tokens (1 + R)] drawn from i alone (`request_length`): with one length
the requests of a wave end at one step under plain decoding, and the next ones arrive together and prefill in one
pass, while under speculation they end a few steps apart; a spread is the traffic a server meets, where answers
differ in length (as the output-length range of vLLM's random dataset does). Request i takes prompt i modulo the prompt list,
which alternates between the prompt files.

Per request: TTFT (from submission to the first streamed text or token ids, so it includes any wait for the engine),
end-to-end latency and tokens. Per level: aggregate tokens/s (all tokens over the level's wall time), p50/p95 of
TTFT and latency, the mean of each request's own tokens/s (tokens over its latency) and, optionally, the wall time
of the same requests one after another (one client) with the concurrent run's speed-up over it. That baseline runs
on the same engine, at the same `max_batch`; the single-request path (`max_batch` 1, CUDA graphs on a GPU) is a
separate run with `--max-batch 1`.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import random
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from dflash.bench.provenance import provenance
from dflash.engine.engine import Engine, EngineOptions
from dflash.errors import DFlashError
from dflash.fastpath.dispatch import graph_runner_of
from dflash.generation.request import GenerationRequest, GenerationResult, TokenCallback
from dflash.generation.sampling import SamplingParams
from dflash.progress import progress_bar
from dflash.training.prompts import read_prompt_file

MODE_SPECS = {"ar": "none", "linear": "linear", "ddtree": "ddtree"}  # bench mode -> the engine's spec per request


class Generator(Protocol):
    def generate(
        self,
        request: GenerationRequest,
        *,
        on_text: TokenCallback | None = None,
        should_stop: Callable[[], bool] | None = None,
        spec: str | None = None,
    ) -> GenerationResult: ...


class OneAtATime:
    """Lets one `generate` call run at a time: for an engine that is not safe to call from several threads (one
    without `EngineOptions.max_batch`); the waiting counts in the requests' TTFT, as it would behind a server."""

    def __init__(self, inner: Generator) -> None:
        self.inner = inner
        self._lock = threading.Lock()

    def generate(
        self,
        request: GenerationRequest,
        *,
        on_text: TokenCallback | None = None,
        should_stop: Callable[[], bool] | None = None,
        spec: str | None = None,
    ) -> GenerationResult:
        with self._lock:
            return self.inner.generate(request, on_text=on_text, should_stop=should_stop, spec=spec)


def engine_takes_threads() -> bool:
    """Whether `Engine.generate` may be called from several threads at once: engines with `max_batch` (which decode
    up to that many requests together and queue the rest)."""
    return any(field.name == "max_batch" for field in dataclasses.fields(EngineOptions))


@dataclass(frozen=True)
class RequestTiming:
    ttft_s: float
    latency_s: float
    tokens: int
    acceptance_length: float  # 0.0 without speculative rounds


@dataclass(frozen=True)
class LoopRun:
    wall_s: float
    requests: list[RequestTiming]  # in submission order


def requests_per_level(level: int, fixed: int | None) -> int:
    """`fixed` when given, else two per client and at least 4, so every client finishes at least two requests."""
    return fixed if fixed is not None else max(2 * level, 4)


def percentile(values: Sequence[float], fraction: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default): p50 of [1, 2, 3, 4] is 2.5."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    position = fraction * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


GREEDY = SamplingParams(temperature=0.0)


def request_length(index: int, max_tokens: int, spread: float = 0.0) -> int:
    """Request `index`'s tokens: `max_tokens`, or for a spread R in (0, 1) an integer drawn uniformly from
    [max_tokens (1 - R), max_tokens (1 + R)] by a generator seeded with `index` (the same in every mode, level and
    run)."""
    if not 0.0 <= spread < 1.0:
        raise DFlashError(f"the length spread must be in [0, 1), got {spread}")
    if spread == 0.0:
        return max_tokens
    low = max(1, round(max_tokens * (1 - spread)))
    return random.Random(index).randint(low, max(low, round(max_tokens * (1 + spread))))


def timed_request(
    generator: Generator, prompt_ids: list[int], *, spec: str, max_tokens: int, sampling: SamplingParams = GREEDY
) -> RequestTiming:
    first_output: list[float] = []

    def on_text(text: str, ids: list[int]) -> None:
        if not first_output and (text or ids):
            first_output.append(time.perf_counter())

    request = GenerationRequest(
        prompt_ids=prompt_ids, max_new_tokens=max_tokens, sampling=sampling, ignore_eos=True
    )
    submitted = time.perf_counter()
    result = generator.generate(request, on_text=on_text, spec=spec)
    ended = time.perf_counter()
    return RequestTiming(
        ttft_s=(first_output[0] if first_output else ended) - submitted,
        latency_s=ended - submitted,
        tokens=len(result.token_ids),
        acceptance_length=result.stats.acceptance_length,
    )


def closed_loop(
    generator: Generator, prompts: Sequence[list[int]], *, spec: str, clients: int, requests: int, max_tokens: int,
    sampling: SamplingParams = GREEDY, length_spread: float = 0.0,
) -> LoopRun:
    """`requests` requests (request i on prompt i mod len(prompts), `request_length(i, ...)` tokens, sampled with
    seed i unless greedy) from `clients` threads, each starting its next request when its previous one ends."""
    if clients < 1 or requests < 1 or not prompts:
        raise ValueError(f"need clients, requests and prompts (got {clients}, {requests}, {len(prompts)})")
    # A pool of `clients` threads over a queue of all the requests is exactly `clients` closed-loop clients: a thread
    # takes the next queued request only once its own has returned.
    with ThreadPoolExecutor(max_workers=clients, thread_name_prefix="bench-client") as pool:
        started = time.perf_counter()
        futures = [
            pool.submit(timed_request, generator, prompts[i % len(prompts)], spec=spec,
                        max_tokens=request_length(i, max_tokens, length_spread),
                        sampling=sampling if sampling.greedy else dataclasses.replace(sampling, seed=i))
            for i in range(requests)
        ]
        try:
            timings = [future.result() for future in futures]
        except BaseException:
            for future in futures:
                future.cancel()
            raise
        wall = time.perf_counter() - started
    return LoopRun(wall_s=wall, requests=timings)


def summarise(run: LoopRun, clients: int) -> dict[str, Any]:
    tokens = sum(t.tokens for t in run.requests)
    ttft = [t.ttft_s for t in run.requests]
    latency = [t.latency_s for t in run.requests]
    acceptance = [t.acceptance_length for t in run.requests if t.acceptance_length > 0]
    return {
        "concurrency": clients,
        "requests": len(run.requests),
        "tokens": tokens,
        "wall_s": round(run.wall_s, 4),
        "tokens_per_s": round(tokens / run.wall_s, 3),
        "ttft_s": {"p50": round(percentile(ttft, 0.5), 4), "p95": round(percentile(ttft, 0.95), 4)},
        "latency_s": {"p50": round(percentile(latency, 0.5), 4), "p95": round(percentile(latency, 0.95), 4)},
        "request_tokens_per_s": round(statistics.fmean(t.tokens / t.latency_s for t in run.requests), 3),
        "acceptance_length": round(statistics.fmean(acceptance), 4) if acceptance else None,
    }


def measure_levels(
    generator: Generator,
    prompts: Sequence[list[int]],
    *,
    modes: Sequence[str],
    levels: Sequence[int],
    max_tokens: int,
    requests: int | None = None,
    sequential: bool = False,
    warmup: bool = True,
    advance: Callable[[int], None] = lambda n: None,
    warmup_requests: int | None = None,
    sampling: SamplingParams = GREEDY,
    length_spread: float = 0.0,
) -> dict[str, list[dict[str, Any]]]:
    """Per mode, one summary per level. Levels run in the outer loop, so the modes of one level are measured close
    together in time. Warm-up (untimed): one request per client at every level, per mode, so that the batch shapes
    of each level are seen (captured graphs, allocator) before any is timed; `warmup_requests` (at least the level's
    clients): that many instead, e.g. the timed level's count, so that every prompt's chunk shapes and the key
    lengths the timed requests reach are captured before it. `advance` is told of every request."""
    unknown = [m for m in modes if m not in MODE_SPECS]
    if unknown:
        raise DFlashError(f"unknown concurrency mode(s) {', '.join(unknown)}; choose from {', '.join(MODE_SPECS)}")
    if not levels or min(levels) < 1:
        raise DFlashError(f"concurrency levels must be at least 1, got {list(levels)}")
    if requests is not None and requests < max(levels):
        raise DFlashError(f"--requests {requests} leaves concurrency {max(levels)} without enough requests")
    request_length(0, max_tokens, length_spread)  # a bad spread fails before any level runs
    loop = functools.partial(closed_loop, generator, prompts, max_tokens=max_tokens, sampling=sampling,
                             length_spread=length_spread)
    if warmup:
        for mode, level in itertools.product(modes, levels):
            count = max(level, warmup_requests or 0)
            loop(spec=MODE_SPECS[mode], clients=level, requests=count)
            advance(count)
    results: dict[str, list[dict[str, Any]]] = {mode: [] for mode in modes}
    core = getattr(getattr(generator, "loop", None), "core", None)  # the batched core, where the engine has one
    for level, mode in itertools.product(levels, modes):
        count = requests_per_level(level, requests)
        before = _step_counts(core)
        run = loop(spec=MODE_SPECS[mode], clients=level, requests=count)
        advance(count)
        row = summarise(run, level)
        if core is not None:
            row["steps"] = _step_difference(_step_counts(core), before)
        if sequential:
            alone = loop(spec=MODE_SPECS[mode], clients=1, requests=count)
            advance(count)
            row["sequential_wall_s"] = round(alone.wall_s, 4)
            row["sequential_tokens_per_s"] = round(row["tokens"] / alone.wall_s, 3)
            row["speedup_over_sequential"] = round(alone.wall_s / run.wall_s, 3)
        results[mode].append(row)
    return results


def interleaved_prompts(engine: Engine, prompt_files: Sequence[Path]) -> list[list[int]]:
    """Every prompt of every file, alternating between the files, so the first requests of a level mix the sets."""
    per_file = [[engine.prompt_set_ids(chat) for chat in read_prompt_file(path)] for path in prompt_files]
    return [ids for group in itertools.zip_longest(*per_file) for ids in group if ids is not None]


def measure_concurrency(
    engine: Engine,
    prompt_files: Sequence[Path],
    *,
    modes: Sequence[str],
    levels: Sequence[int],
    max_tokens: int,
    requests: int | None = None,
    sequential: bool = False,
    warmup: bool = True,
    warmup_requests: int | None = None,
    sampling: SamplingParams = GREEDY,
    length_spread: float = 0.0,
) -> dict[str, Any]:
    """The levels on `engine` (serialised with `OneAtATime` where it cannot batch), with provenance."""
    if engine.drafter is None and any(MODE_SPECS.get(m, "none") != "none" for m in modes):
        raise DFlashError("modes linear and ddtree need a drafter (--draft); measure ar alone without one")
    prompts = interleaved_prompts(engine, prompt_files)
    if not prompts:
        raise DFlashError("no prompts in " + ", ".join(str(p) for p in prompt_files))
    generator: Generator = engine if engine_takes_threads() else OneAtATime(engine)
    max_batch = getattr(engine.options, "max_batch", None)
    timed = sum(requests_per_level(level, requests) for level in levels) * (2 if sequential else 1)
    warming = sum(max(level, warmup_requests or 0) for level in levels) if warmup else 0
    total = len(modes) * (timed + warming)
    with progress_bar("concurrency", total) as bar:
        results = measure_levels(
            generator, prompts, modes=modes, levels=levels, max_tokens=max_tokens, requests=requests,
            sequential=sequential, warmup=warmup, advance=bar.advance, warmup_requests=warmup_requests,
            sampling=sampling, length_spread=length_spread,
        )
    return {
        **provenance(engine.device),
        "dtype": str(engine.target.embed_tokens.weight.dtype).removeprefix("torch."),
        "model": engine.model_name,
        "drafter": engine.drafter is not None,
        "ddtree_budget": engine.options.ddtree_budget,
        "num_drafts": engine.options.num_drafts,
        "cuda_graphs": graph_runner_of(engine.target) is not None,
        "batched": (max_batch or 1) > 1,  # False: the engine ran one request at a time, the others waited
        "max_batch": max_batch,
        "sampling": (
            "greedy" if sampling.greedy
            else f"temperature {sampling.temperature}, top_p {sampling.top_p}, request i seeded with i"
        ) + ", ignore_eos (every request produces exactly its length)",
        "max_tokens": max_tokens,
        # request i's length: max_tokens, or drawn from i in [max_tokens (1 - spread), max_tokens (1 + spread)]
        "length_spread": length_spread,
        "prompts": len(prompts),
        "prompt_files": [str(p) for p in prompt_files],
        "levels": list(levels),
        "warmup": warmup,
        "warmup_requests": warmup_requests if warmup else 0,  # None: one request per client
        "modes": results,
        **_tree_budgets(engine),
    }


def _step_counts(core: Any) -> dict[str, dict[str, float]]:
    """The core's steps so far: by kind [steps, seconds], and by (request bucket, tree option) chosen."""
    if core is None:
        return {}
    chosen = {f"{bucket}:{option}": count for (bucket, option), count in core.tree_budgets.chosen.items()}
    chains = getattr(core, "chain_lengths", None)  # linear requests' chains on the device
    if chains is not None:
        chosen.update({f"{bucket}:chain{option}": count for (bucket, option), count in chains.chosen.items()})
    return {"kinds": {k: list(v) for k, v in core.step_kinds.items()}, "chosen": chosen}


def _step_difference(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    """A level's steps: by kind {steps, ms}, and the tree options chosen ("bucket:option": steps; 0 is plain;
    "bucket:chainN": chains of N drafts, "bucket:chain0" plain steps of linear requests)."""
    kinds = {}
    for kind, (count, seconds) in sorted(after["kinds"].items()):
        old = before["kinds"].get(kind, [0, 0.0])
        if count > old[0]:
            kinds[kind] = {"steps": int(count - old[0]), "ms": round((seconds - old[1]) * 1e3, 1)}
    chosen = {key: count - before["chosen"].get(key, 0) for key, count in sorted(after["chosen"].items())}
    return {"kinds": kinds, "tree_options": {key: count for key, count in chosen.items() if count}}


def _tree_budgets(engine: Engine) -> dict[str, Any]:
    """What the batched core's tree-budget choice did over the run (`dflash.batch.tree_budgets`) and its steps by
    kind (count, time to the next step), where it ran; how often speculation paused under load, where it did."""
    core = getattr(getattr(engine, "loop", None), "core", None)
    found: dict[str, Any] = {}
    for name in ("tree_budgets", "chain_lengths"):
        chooser = getattr(core, name, None)
        if chooser is not None and chooser.chosen:
            found[name] = chooser.summary()
    pause = getattr(core, "pause", None)  # speculation paused under load (`dflash.batch.speculation_pause`)
    if pause is not None and pause.pauses:
        found["speculation_pause"] = {
            "pauses": pause.pauses, "paused_requests": pause.paused_requests,
            "round_gains": [None if g is None else round(g, 3) for g in pause.gains],
        }
    return found


def format_concurrency_table(result: dict[str, Any]) -> str:
    batching = f"max_batch {result['max_batch']}" if result["batched"] else "no batching: one request at a time"
    lines = [f"{result['model']} on {result['device']}, {result['max_tokens']} tokens per request, {batching}"]
    header = f"{'mode':<8}{'clients':>8}{'reqs':>6}{'tok/s':>10}{'req tok/s':>11}{'TTFT p50/p95 s':>18}"
    header += f"{'latency p50/p95 s':>20}"
    sequential = any("speedup_over_sequential" in row for rows in result["modes"].values() for row in rows)
    if sequential:
        header += f"{'seq tok/s':>11}{'speed-up':>10}"
    lines.append(header)
    for mode, rows in result["modes"].items():
        for row in rows:
            ttft = f"{row['ttft_s']['p50']:.3f}/{row['ttft_s']['p95']:.3f}"
            latency = f"{row['latency_s']['p50']:.3f}/{row['latency_s']['p95']:.3f}"
            line = f"{mode:<8}{row['concurrency']:>8}{row['requests']:>6}{row['tokens_per_s']:>10.1f}"
            line += f"{row['request_tokens_per_s']:>11.1f}{ttft:>18}{latency:>20}"
            if "speedup_over_sequential" in row:
                line += f"{row['sequential_tokens_per_s']:>11.1f}{row['speedup_over_sequential']:>9.2f}x"
            lines.append(line)
    return "\n".join(lines)
