"""`dflash bench concurrency`: closed-loop clients, counting, percentiles and the sequential baseline on a stand-in
engine whose requests sleep; one short run of the command on the real default engine."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from dflash.bench.concurrency import (
    OneAtATime,
    closed_loop,
    engine_takes_threads,
    measure_levels,
    percentile,
    request_length,
    requests_per_level,
    summarise,
)
from dflash.errors import DFlashError
from dflash.generation.request import GenerationRequest, GenerationResult, GenerationStats, TokenCallback
from dflash.generation.sampling import SamplingParams
from dflash.training.prompts import write_prompt_file


class StandInEngine:
    """Each request waits `first_s` before its first token and `rest_s` for the others, however many run at once
    (a perfectly batching engine); records the requests, specs and the most calls in flight together."""

    def __init__(self, first_s: float = 0.03, rest_s: float = 0.03, fail_on: int | None = None) -> None:
        self.first_s, self.rest_s, self.fail_on = first_s, rest_s, fail_on
        self.lock = threading.Lock()
        self.in_flight = self.peak = 0
        self.requests: list[GenerationRequest] = []
        self.specs: list[str | None] = []

    def generate(
        self,
        request: GenerationRequest,
        *,
        on_text: TokenCallback | None = None,
        should_stop: Callable[[], bool] | None = None,
        spec: str | None = None,
    ) -> GenerationResult:
        with self.lock:
            self.in_flight += 1
            self.peak = max(self.peak, self.in_flight)
            self.requests.append(request)
            self.specs.append(spec)
            number = len(self.requests)
        try:
            if number == self.fail_on:
                raise RuntimeError("stand-in failure")
            ids = [request.prompt_ids[0]] * request.max_new_tokens
            assert on_text is not None
            on_text("", [])  # a callback with nothing in it is not the first output
            time.sleep(self.first_s)
            on_text("x", ids[:1])
            time.sleep(self.rest_s)
            on_text("x" * (len(ids) - 1), ids[1:])
        finally:
            with self.lock:
                self.in_flight -= 1
        stats = GenerationStats(completion_tokens=len(ids), rounds=4 if spec != "none" else 0, accepted_tokens=8)
        return GenerationResult(text="x" * len(ids), token_ids=ids, finish_reason="length", stats=stats)


PROMPTS = [[11, 1], [12, 1], [13, 1]]


def test_percentile_interpolates_between_closest_ranks() -> None:
    assert percentile([4.0, 1.0, 3.0, 2.0], 0.5) == 2.5
    assert percentile([float(v) for v in range(1, 21)], 0.95) == pytest.approx(19.05)
    assert percentile([7.0], 0.95) == 7.0
    assert percentile([1.0, 9.0], 0.0) == 1.0 and percentile([1.0, 9.0], 1.0) == 9.0
    with pytest.raises(ValueError):
        percentile([], 0.5)


def test_requests_per_level_defaults_to_two_per_client_and_at_least_four() -> None:
    assert [requests_per_level(level, None) for level in (1, 2, 3, 8, 32)] == [4, 4, 6, 16, 64]
    assert requests_per_level(8, 5) == 5


def test_closed_loop_keeps_level_requests_in_flight_and_counts_tokens() -> None:
    engine = StandInEngine()
    run = closed_loop(engine, PROMPTS, spec="linear", clients=4, requests=10, max_tokens=6)
    assert engine.peak == 4  # never more than the clients, and the queue kept all of them busy
    assert len(run.requests) == len(engine.requests) == 10
    assert sorted(r.prompt_ids[0] for r in engine.requests) == sorted(PROMPTS[i % 3][0] for i in range(10))
    assert all(r.ignore_eos and r.sampling.temperature == 0 and r.max_new_tokens == 6 for r in engine.requests)
    assert set(engine.specs) == {"linear"}
    row = summarise(run, 4)
    assert row["requests"] == 10 and row["tokens"] == 60 and row["concurrency"] == 4
    assert row["tokens_per_s"] == pytest.approx(60 / run.wall_s, rel=1e-3)
    # TTFT: after the stand-in's first wait (the empty callback does not count), before the request's end
    assert 0.03 <= row["ttft_s"]["p50"] < row["latency_s"]["p50"]
    assert row["ttft_s"]["p50"] <= row["ttft_s"]["p95"] and row["latency_s"]["p50"] <= row["latency_s"]["p95"]
    assert row["latency_s"]["p50"] >= 0.06
    # 10 requests of ~0.06 s in 3 waves of 4 clients: far below the 0.6 s one after another
    assert run.wall_s < 0.45
    expected = sum(t.tokens / t.latency_s for t in run.requests) / 10
    assert row["request_tokens_per_s"] == pytest.approx(expected, rel=1e-3)
    assert row["acceptance_length"] == pytest.approx(3.0)  # (8 accepted + 4 rounds) / 4 rounds


def test_sampled_levels_seed_each_request_by_its_index() -> None:
    """At a temperature, request i is sampled with seed i (the same request in every mode and level)."""
    engine = StandInEngine(first_s=0.0, rest_s=0.0)
    closed_loop(engine, PROMPTS, spec="ddtree", clients=2, requests=5, max_tokens=3,
                sampling=SamplingParams(temperature=0.7, top_p=0.9))
    by_seed = sorted(engine.requests, key=lambda r: r.sampling.seed or 0)
    assert [r.sampling.seed for r in by_seed] == [0, 1, 2, 3, 4]
    assert [r.prompt_ids[0] for r in by_seed] == [PROMPTS[i % 3][0] for i in range(5)]
    assert all(r.sampling.temperature == 0.7 and r.sampling.top_p == 0.9 and r.ignore_eos for r in by_seed)


def test_a_length_spread_gives_each_request_its_own_length_the_same_in_every_mode() -> None:
    """With a spread, request i's length is drawn from i alone within [max_tokens (1 - R), max_tokens (1 + R)]: the
    lengths differ between requests (the arrivals they cause spread out) and repeat in every mode and level."""
    lengths = [request_length(i, 100, 0.5) for i in range(200)]
    assert min(lengths) >= 50 and max(lengths) <= 150 and len(set(lengths)) > 50
    assert lengths == [request_length(i, 100, 0.5) for i in range(200)]
    assert [request_length(i, 100) for i in range(5)] == [100] * 5
    with pytest.raises(DFlashError, match="spread"):
        request_length(0, 100, 1.0)
    engine = StandInEngine(first_s=0.0, rest_s=0.0)
    rows = measure_levels(engine, PROMPTS, modes=["ar", "ddtree"], levels=[3], max_tokens=40, requests=9,
                          warmup=False, length_spread=0.5)
    expected = sum(request_length(i, 40, 0.5) for i in range(9))
    assert rows["ar"][0]["tokens"] == rows["ddtree"][0]["tokens"] == expected != 9 * 40
    by_mode = {spec: sorted(r.max_new_tokens for r, s in zip(engine.requests, engine.specs, strict=True) if s == spec)
               for spec in ("none", "ddtree")}
    assert by_mode["none"] == by_mode["ddtree"] == sorted(request_length(i, 40, 0.5) for i in range(9))


def test_one_client_runs_requests_one_after_another() -> None:
    engine = StandInEngine(first_s=0.01, rest_s=0.01)
    run = closed_loop(engine, PROMPTS, spec="none", clients=1, requests=5, max_tokens=3)
    assert engine.peak == 1
    assert run.wall_s >= sum(t.latency_s for t in run.requests) * 0.99
    assert summarise(run, 1)["acceptance_length"] is None


def test_sequential_ratio_shows_batching_and_its_absence() -> None:
    batching = StandInEngine(first_s=0.02, rest_s=0.02)
    rows = measure_levels(batching, PROMPTS, modes=["ar"], levels=[4], max_tokens=4, sequential=True, warmup=False)
    row = rows["ar"][0]
    assert row["requests"] == 8 and row["tokens"] == 32
    assert row["sequential_wall_s"] > row["wall_s"]
    assert 2.5 <= row["speedup_over_sequential"] <= 4.5  # ideal: 8 requests in 2 waves instead of 8
    assert row["sequential_tokens_per_s"] == pytest.approx(32 / row["sequential_wall_s"], rel=1e-2)

    inner = StandInEngine(first_s=0.02, rest_s=0.02)
    rows = measure_levels(
        OneAtATime(inner), PROMPTS, modes=["ar"], levels=[4], max_tokens=4, sequential=True, warmup=False
    )
    row = rows["ar"][0]
    assert inner.peak == 1  # the wrapper lets one call through at a time
    assert 0.6 <= row["speedup_over_sequential"] <= 1.5
    # queued behind the others: the slowest first tokens wait for about three whole requests
    assert row["ttft_s"]["p95"] >= 0.1


def test_measure_levels_maps_modes_warms_up_and_orders_levels() -> None:
    engine = StandInEngine(first_s=0.0, rest_s=0.001)
    told: list[int] = []
    rows = measure_levels(
        engine, PROMPTS, modes=["ar", "ddtree"], levels=[1, 3], max_tokens=2, warmup=True, advance=told.append
    )
    assert [row["concurrency"] for row in rows["ar"]] == [1, 3] == [row["concurrency"] for row in rows["ddtree"]]
    assert [row["requests"] for row in rows["ddtree"]] == [4, 6]
    # warm-up: one request per client per level and mode; then 4 + 6 timed requests per mode
    assert len(engine.requests) == sum(told) == 2 * (1 + 3) + 2 * (4 + 6)
    assert set(engine.specs) == {"none", "ddtree"}
    with pytest.raises(DFlashError, match="tree"):
        measure_levels(engine, PROMPTS, modes=["tree"], levels=[1], max_tokens=2)
    with pytest.raises(DFlashError, match="--requests 2"):
        measure_levels(engine, PROMPTS, modes=["ar"], levels=[1, 4], max_tokens=2, requests=2)


def test_warm_up_can_run_as_many_requests_as_the_timed_level() -> None:
    """`warmup_requests`: that many untimed requests per level and mode (never fewer than the level's clients), on
    the same prompts the timed level then sends."""
    engine = StandInEngine(first_s=0.0, rest_s=0.001)
    told: list[int] = []
    measure_levels(engine, PROMPTS, modes=["ar"], levels=[1, 3], max_tokens=2, requests=5, warmup=True,
                   warmup_requests=5, advance=told.append)
    assert told == [5, 5, 5, 5]  # warm-up of each level, then each timed level
    assert len(engine.requests) == 20
    assert engine.requests[:5] == engine.requests[10:15]  # the first level's warm-up sends its timed prompts
    told.clear()
    measure_levels(engine, PROMPTS, modes=["ar"], levels=[4], max_tokens=2, requests=4, warmup=True,
                   warmup_requests=2, advance=told.append)
    assert told == [4, 4]  # at least one request per client


def test_a_failed_request_fails_the_level() -> None:
    with pytest.raises(RuntimeError, match="stand-in failure"):
        closed_loop(StandInEngine(first_s=0.0, rest_s=0.0, fail_on=3), PROMPTS, spec="none", clients=2,
                    requests=6, max_tokens=2)


def test_max_batch_is_one_option_with_the_shared_max_concurrency() -> None:
    from dflash.cli import build_parser

    parse = build_parser().parse_args
    assert parse(["bench", "concurrency", "--max-batch", "3"]).max_concurrency == 3
    assert parse(["bench", "concurrency", "--max-concurrency", "5"]).max_concurrency == 5
    defaults = parse(["bench", "concurrency"])
    assert defaults.max_concurrency is None and defaults.concurrency == "1,2,4,8,16,32" and defaults.warmup
    assert defaults.modes == "ar,linear,ddtree" and defaults.max_tokens == 128 and defaults.requests is None


@pytest.mark.slow
def test_command_on_the_default_engine(tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    write_prompt_file(prompts, ["Name three colours.", "Write a Python function that adds two numbers."])
    out_file = tmp_path / "concurrency.json"
    args = ["bench", "concurrency", "--prompts-file", str(prompts), "--concurrency", "1,2", "--modes", "ar,ddtree",
            "--requests", "2", "--max-tokens", "6", "--sequential", "--ddtree-budget", "4", "--json", "--out",
            str(out_file)]
    done = subprocess.run([sys.executable, "-m", "dflash", *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    printed = json.loads(done.stdout.strip().splitlines()[-1])
    saved = json.loads(out_file.read_text())
    assert printed == saved
    assert saved["levels"] == [1, 2] and saved["prompts"] == 2 and saved["drafter"] is True
    assert saved["batched"] == engine_takes_threads()
    assert saved["max_batch"] == (2 if engine_takes_threads() else None)
    assert saved["command"].startswith("dflash bench concurrency") and "torch" in saved["versions"]
    for mode, rows in saved["modes"].items():
        assert [row["concurrency"] for row in rows] == [1, 2], mode
        for row in rows:
            assert row["tokens"] == 2 * 6  # EOS ignored: every request makes exactly max tokens
            assert row["tokens_per_s"] > 0 and row["sequential_tokens_per_s"] > 0
            assert 0 < row["ttft_s"]["p50"] <= row["latency_s"]["p95"]
    assert saved["modes"]["ddtree"][0]["acceptance_length"] >= 1.0
    assert saved["modes"]["ar"][0]["acceptance_length"] is None
