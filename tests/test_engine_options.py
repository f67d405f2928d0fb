"""Engine options: frozen records, defaults resolved per device class into a copy, the caller's record untouched."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dflash.engine.engine import (
    DEFAULT_DDTREE_BUDGET,
    DEFAULT_MAX_BATCH,
    DEFAULT_NUM_DRAFTS,
    EngineOptions,
    resolve_options,
)
from dflash.engine.loading import LoadOptions
from dflash.errors import DFlashError

CPU = torch.device("cpu")


def test_options_records_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        EngineOptions().spec = "none"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        LoadOptions().device = "cpu"  # type: ignore[misc]


def test_defaults_of_the_device_class_fill_a_copy() -> None:
    given = EngineOptions()
    resolved = resolve_options(given, device=CPU, has_drafter=True, tensor_parallel=False)
    assert given == EngineOptions()  # the caller's record is left as it was
    assert resolved.spec == "ddtree"
    assert resolved.ddtree_budget == DEFAULT_DDTREE_BUDGET["cpu"]
    assert resolved.num_drafts == DEFAULT_NUM_DRAFTS["cpu"]
    assert resolved.max_batch == DEFAULT_MAX_BATCH["cpu"]
    assert resolved.cuda_graphs


def test_chosen_values_are_kept() -> None:
    given = EngineOptions(spec="linear", ddtree_budget=5, num_drafts=2, max_batch=3)
    resolved = resolve_options(given, device=torch.device("cuda"), has_drafter=True, tensor_parallel=False)
    assert (resolved.spec, resolved.ddtree_budget, resolved.num_drafts, resolved.max_batch) == ("linear", 5, 2, 3)


def test_a_device_class_without_measurements_gets_the_fallbacks() -> None:
    resolved = resolve_options(EngineOptions(), device=torch.device("meta"), has_drafter=True, tensor_parallel=False)
    assert (resolved.ddtree_budget, resolved.num_drafts, resolved.max_batch) == (16, None, 1)


def test_without_a_drafter_decoding_is_plain() -> None:
    resolved = resolve_options(EngineOptions(spec="ddtree"), device=CPU, has_drafter=False, tensor_parallel=False)
    assert resolved.spec == "none"


def test_tensor_parallel_runs_one_request_with_graphs() -> None:
    given = EngineOptions(max_batch=8, cuda_graphs=True)
    resolved = resolve_options(given, device=CPU, has_drafter=True, tensor_parallel=True)
    assert resolved.max_batch == 1 and resolved.cuda_graphs  # every rank captures its graphs, all-reduces inside
    assert given.max_batch == 8 and given.cuda_graphs
    assert not resolve_options(given, device=CPU, has_drafter=True, tensor_parallel=True, capturable=False).cuda_graphs


@pytest.mark.parametrize(
    ("options", "message"),
    [(EngineOptions(spec="medusa"), "unknown --spec"), (EngineOptions(max_batch=0), "at least 1")],
)
def test_bad_options_are_refused(options: EngineOptions, message: str) -> None:
    with pytest.raises(DFlashError, match=message):
        resolve_options(options, device=CPU, has_drafter=True, tensor_parallel=False)


def test_new_options_reach_the_batched_core() -> None:
    """Setting `Engine.options` (benchmarks try tree budgets so) stops a loop made with the old ones: the next
    batched generation runs a core with the new tree budget, not the one copied when the first loop started."""
    from dflash.engine.engine import Engine
    from dflash.generation.request import GenerationRequest
    from tests.parallel_helpers import ENGINE_VOCAB, word_tokenizer
    from tests.spec_helpers import tiny_random_pair

    target, drafter = tiny_random_pair(ENGINE_VOCAB, 0.3, block=5)
    engine = Engine(target, word_tokenizer(ENGINE_VOCAB), drafter, EngineOptions(max_batch=2, ddtree_budget=4))
    request = GenerationRequest(prompt_ids=[1, 2, 3, 4], max_new_tokens=6, ignore_eos=True)
    try:
        first = engine.generate(request, spec="ddtree")
        assert engine.loop.core.settings.ddtree_budget == 4
        engine.options = dataclasses.replace(engine.options, ddtree_budget=7)
        assert engine.generate(request, spec="ddtree").token_ids == first.token_ids
        assert engine.loop.core.settings.ddtree_budget == 7
    finally:
        engine.close()


def test_the_pool_floor_is_held_against_the_memory_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """A batched core needs at least one full context in its pools: `pool_floor_fits` compares exactly those bytes
    (target and drafter K/V per position) with the device's budget."""
    from dflash.batch import memory
    from tests.parallel_helpers import ENGINE_VOCAB
    from tests.spec_helpers import tiny_random_pair

    target, drafter = tiny_random_pair(ENGINE_VOCAB, 0.3, block=5)
    floor = memory.pool_floor_tokens(max_ctx=1000, round_rows=9) * memory.bytes_per_position(target, drafter)
    assert floor == 1018 * memory.bytes_per_position(target, drafter) > 0
    for budget, fits in ((floor, True), (floor - 1, False)):
        monkeypatch.setattr(memory, "memory_budget", lambda device, budget=budget: budget)
        assert memory.pool_floor_fits(target, drafter, max_ctx=1000, round_rows=9) is fits


@pytest.mark.parametrize(("fits", "given", "expected"), [(True, None, 8), (False, None, 1), (False, 3, 3)])
def test_the_gpu_batches_by_default_where_the_pool_fits(
    monkeypatch: pytest.MonkeyPatch, fits: bool, given: int | None, expected: int
) -> None:
    """On a GPU the default is 8 requests at a time, dropped to 1 where the batched pool's floor would not fit beside
    the single-request path; a batch the caller chose is kept whatever the memory."""
    from dflash.engine import engine as engine_module
    from dflash.engine.engine import Engine
    from tests.parallel_helpers import ENGINE_VOCAB, word_tokenizer
    from tests.spec_helpers import tiny_random_pair

    assert DEFAULT_MAX_BATCH["cuda"] == 8
    seen: list[int] = []

    def floor_fits(target: object, drafter: object, *, max_ctx: int, round_rows: int) -> bool:
        seen.append(round_rows)
        return fits

    monkeypatch.setattr(engine_module, "pool_floor_fits", floor_fits)
    target, drafter = tiny_random_pair(ENGINE_VOCAB, 0.3, block=5)
    options = EngineOptions(max_batch=given, ddtree_budget=4, cuda_graphs=False)
    engine = Engine(target, word_tokenizer(ENGINE_VOCAB), drafter, options)
    assert seen == [] and engine.options.max_batch == (given or DEFAULT_MAX_BATCH["cpu"])  # a CPU keeps its batch
    # the same engine deciding as on a GPU (the device class is all the decision reads of the device)
    monkeypatch.setattr(Engine, "device", property(lambda self: torch.device("cuda")))
    engine._fit_default_batch()
    assert seen == ([5 + 4] if given is None else [])  # the round's rows: a block and a tree
    assert engine.options.max_batch == expected
