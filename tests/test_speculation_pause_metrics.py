"""Speculation pauses under load, as the engine counts them (across its engine loops) and as `/metrics` shows them:
an operator can see why speculative requests decode plainly while many requests share the server."""

from __future__ import annotations

import functools
import threading

import pytest

from dflash.batch import speculation_pause
from dflash.batch.core_settings import CoreSettings
from dflash.batch.speculation_pause import MIN_REQUESTS
from dflash.engine import engine as engine_module
from dflash.engine.engine import Engine, EngineOptions
from dflash.generation.request import GenerationRequest, GenerationResult
from dflash.generation.sampling import SamplingParams
from dflash.server import ServerSettings, create_app
from tests.parallel_helpers import ENGINE_VOCAB, word_tokenizer
from tests.server_helpers import metric, serving
from tests.spec_helpers import tiny_random_pair


def _run_together(engine: Engine, count: int) -> list[GenerationResult]:
    """`count` seeded sampled requests at once, each on its own thread."""
    results: list[GenerationResult | None] = [None] * count

    def one(index: int) -> None:
        prompt = [(index * 7 + i * 5) % (ENGINE_VOCAB - 2) + 1 for i in range(6 + index % 5)]
        request = GenerationRequest(prompt_ids=prompt, max_new_tokens=48, ignore_eos=True,
                                    sampling=SamplingParams(temperature=1.0, seed=index))
        results[index] = engine.generate(request)

    threads = [threading.Thread(target=one, args=(index,)) for index in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert all(result is not None for result in results)
    return [result for result in results if result is not None]


def _paused_engine(monkeypatch: pytest.MonkeyPatch) -> Engine:
    """A batched DDTree engine whose steps are built as on a GPU (the padded passes, eager here: the device rounds'
    chooser decides them) and whose chooser takes plain steps only (speculation never pays there), pausing after
    two such steps."""
    monkeypatch.setattr(speculation_pause, "PAUSE_AFTER", 2)
    monkeypatch.setattr(engine_module, "CoreSettings", functools.partial(CoreSettings, eager_padded=True))
    target, drafter = tiny_random_pair(ENGINE_VOCAB, 0.3, block=5)
    engine = Engine(target, word_tokenizer(ENGINE_VOCAB), drafter,
                    EngineOptions(spec="ddtree", ddtree_budget=4, max_batch=MIN_REQUESTS, single_request_path=False))
    engine.loop.core.tree_budgets.forced = False
    return engine


def test_the_engine_counts_pauses_across_its_engine_loops(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = _paused_engine(monkeypatch)
    try:
        assert engine.speculation_pauses() == (0, 0)
        results = _run_together(engine, MIN_REQUESTS)
        assert all(len(result.token_ids) == 48 for result in results)
        pauses, requests = engine.speculation_pauses()
        assert pauses >= 1 and requests >= MIN_REQUESTS
        engine.close()  # the loop and its core go; the counts stay
        assert engine.speculation_pauses() == (pauses, requests)
    finally:
        engine.close()


def test_metrics_show_the_pauses(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = _paused_engine(monkeypatch)
    try:
        with serving(create_app(engine, ServerSettings())) as server:
            assert metric(server.url, "dflash_speculation_pauses_total") == 0
            _run_together(engine, MIN_REQUESTS)
            pauses, requests = engine.speculation_pauses()
            assert pauses >= 1
            assert metric(server.url, "dflash_speculation_pauses_total") == pauses
            assert metric(server.url, "dflash_speculation_paused_requests_total") == requests
    finally:
        engine.close()
