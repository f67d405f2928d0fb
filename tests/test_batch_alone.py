"""A batched engine's lone request on the single-request path (`dflash.batch.loop`, `Engine._run_alone`): it runs
there while nothing else decodes, stops at a round when another request arrives and continues in the batched core
from the tokens it produced; every request still gets the tokens it gets alone, its usage counts its own prompt."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from dflash.batch.sequence import Sequence
from dflash.engine.engine import Engine, EngineOptions
from dflash.generation.request import GenerationRequest, GenerationResult
from tests.parallel_helpers import ENGINE_VOCAB, word_tokenizer
from tests.spec_helpers import tiny_random_pair


@pytest.fixture(scope="module")
def pair() -> tuple[Any, Any]:
    return tiny_random_pair(ENGINE_VOCAB, 0.3, block=5)


def _engine(pair: tuple[Any, Any], **options: Any) -> Engine:
    target, drafter = pair
    return Engine(target, word_tokenizer(ENGINE_VOCAB), drafter, EngineOptions(ddtree_budget=4, **options))


def _request(seed: int, length: int, new: int) -> GenerationRequest:
    prompt = [(seed * 7 + i * 5) % (ENGINE_VOCAB - 2) + 1 for i in range(length)]
    return GenerationRequest(prompt_ids=prompt, max_new_tokens=new, ignore_eos=True)


def _count_single_runs(engine: Engine) -> list[str]:
    """Wrap the engine's single-request loops: the list gains each run's mode."""
    runs: list[str] = []
    decode = engine._decode

    def counted(mode: str, *args: Any) -> Any:
        runs.append(mode)
        return decode(mode, *args)

    engine._decode = counted  # type: ignore[method-assign]
    return runs


@pytest.mark.parametrize("spec", ["none", "linear", "ddtree"])
def test_a_lone_request_takes_the_single_request_path(pair: tuple[Any, Any], spec: str) -> None:
    serial = _engine(pair, max_batch=1)
    batched = _engine(pair, max_batch=4)
    runs = _count_single_runs(batched)
    try:
        request = _request(1, 9, 20)
        expected = serial.generate(request, spec=spec)
        got = batched.generate(request, spec=spec)
        assert runs == [spec]
        assert got.token_ids == expected.token_ids
        assert got.stats.prompt_tokens == 9 and got.stats.completion_tokens == 20
        assert batched.loop.core.last_batch == 0  # the batched core never stepped
    finally:
        serial.close()
        batched.close()


@pytest.mark.parametrize("spec", ["none", "linear", "ddtree"])
def test_a_lone_request_yields_to_an_arrival_and_continues_batched(pair: tuple[Any, Any], spec: str) -> None:
    """The second request is submitted from the first one's output callback after 6 tokens: the first stops at
    its next round, joins the batched core with its output as prompt, and both end with their tokens alone."""
    _yield_to_an_arrival(pair, spec)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("spec", ["none", "ddtree"])
def test_on_a_gpu_a_lone_request_yields_from_the_resident_rounds(spec: str) -> None:
    """The same on a CUDA device (float32), where the lone request runs the single-request path's CUDA graphs and
    device-resident rounds and the batched core its graphed padded steps."""
    target, drafter = tiny_random_pair(ENGINE_VOCAB, 0.3, block=5)
    _yield_to_an_arrival((target.cuda(), drafter.cuda()), spec)


def _yield_to_an_arrival(pair: tuple[Any, Any], spec: str) -> None:
    serial = _engine(pair, max_batch=1)
    batched = _engine(pair, max_batch=4)
    first, second = _request(2, 11, 40), _request(3, 7, 16)
    try:
        expected = [serial.generate(r, spec=spec).token_ids for r in (first, second)]
        resumed: list[int] = []
        resume = Sequence.resume_from_output

        def recording(seq: Sequence) -> None:
            resume(seq)
            resumed.append(seq.resumed)

        results: dict[str, GenerationResult] = {}
        failures: list[BaseException] = []
        submitted = threading.Event()

        def submit_second() -> None:
            try:
                results["second"] = batched.generate(second, spec=spec)
            except BaseException as exc:
                failures.append(exc)
                raise

        streamed: list[int] = []

        def on_text(text: str, ids: list[int]) -> None:
            streamed.extend(ids)
            if len(streamed) >= 6 and not submitted.is_set():
                submitted.set()
                threading.Thread(target=submit_second).start()
                while not batched.loop._inbox and batched.loop.waiting == 0 and "second" not in results:
                    pass  # until the arrival is in the loop's inbox: the next round yields

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(Sequence, "resume_from_output", recording)
            results["first"] = batched.generate(first, spec=spec, on_text=on_text)
            assert submitted.is_set()
            while "second" not in results and not failures:
                threading.Event().wait(0.01)
        assert not failures, failures
        assert submitted.is_set() and resumed and 6 <= resumed[0] < 40
        assert results["first"].token_ids == expected[0]
        assert results["second"].token_ids == expected[1]
        assert results["first"].stats.prompt_tokens == 11 and results["first"].stats.completion_tokens == 40
    finally:
        serial.close()
        batched.close()


def test_a_cancelled_lone_request_ends_cancelled(pair: tuple[Any, Any]) -> None:
    batched = _engine(pair, max_batch=4)
    try:
        produced: list[int] = []
        result = batched.generate(
            _request(4, 8, 50), spec="ddtree", on_text=lambda text, ids: produced.extend(ids),
            should_stop=lambda: len(produced) >= 5,
        )
        assert result.finish_reason == "cancelled" and 5 <= len(result.token_ids) < 50
        assert batched.loop.running == 0
    finally:
        batched.close()


def test_the_single_request_path_can_be_switched_off(pair: tuple[Any, Any]) -> None:
    batched = _engine(pair, max_batch=4, single_request_path=False)
    runs = _count_single_runs(batched)
    try:
        batched.generate(_request(5, 6, 8), spec="ddtree")
        assert runs == [] and batched.loop.core.last_batch == 1
    finally:
        batched.close()


def test_a_lone_request_reports_each_round_as_a_step(pair: tuple[Any, Any]) -> None:
    """The step observer (the server flushes a step's streamed text there) hears from a lone request at every
    round, while it is still producing, not only at its end."""
    batched = _engine(pair, max_batch=4)
    streamed: list[int] = []
    observed: list[tuple[int, int]] = []  # (batch size, tokens streamed by then)
    batched.step_observer = lambda size: observed.append((size, len(streamed)))
    try:
        batched.generate(_request(6, 8, 30), spec="ddtree", on_text=lambda text, ids: streamed.extend(ids))
        assert len(streamed) == 30
        assert all(size == 1 for size, _ in observed)
        assert any(0 < seen < 30 for _, seen in observed)  # mid-generation
        assert observed[-1][1] == 30
    finally:
        batched.close()
