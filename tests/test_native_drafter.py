"""A drafter's layers in one native call (`dflash.drafter.native_drafter`, `kernels/drafter_stack.h`) compute
bitwise what its Python layers compute: the draft scores of every round and every slot of its cache, over rounds
that take in context rows of different counts, for the CPU's Q8_0 drafter on int8 and int8x2 products and for a
golden drafter quantized the same way; a drafter they do not take is left to Python."""

from __future__ import annotations

import copy
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch

from dflash.drafter.model import DFlashDrafter
from dflash.drafter.native_drafter import drafter_runs_natively
from dflash.drafter.quantize import quantize_drafter
from dflash.engine.engine import Engine, EngineOptions
from dflash.engine.loading import load_engine
from dflash.models.cpu_matmul import use_cpu_matmul
from dflash.models.model import CausalLM
from dflash.models.native_stack import runs_natively
from tests.spec_helpers import golden_pair, one_torch_thread
from tests.test_int8_kernel import needs_int8
from tests.test_native_layers import assert_bitwise_equal

_one_thread = one_torch_thread  # autouse, module scope
NATIVE = "DFLASH_CPU_NATIVE_LAYERS"


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    yield load_engine("default", options=EngineOptions(max_batch=1))


def rounds(target: CausalLM, drafter: DFlashDrafter, native: bool, monkeypatch: pytest.MonkeyPatch) -> list[torch.Tensor]:
    """Four drafter rounds after context rows of 9, 3, 1 and 0 positions (features from the target's prompt
    forward), natively or not -> each round's draft scores, then the drafter cache's slots."""
    monkeypatch.setenv(NATIVE, "1" if native else "0")
    config = target.config
    prompt = torch.randint(0, config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(5))
    layer_ids = drafter.config.target_layer_ids
    outputs: list[torch.Tensor] = []
    with torch.inference_mode():
        features = target(prompt, capture=layer_ids, logits="none").features
        assert features is not None
        cache = drafter.new_cache(64)
        start = 0
        for count in (9, 3, 1, 0):
            new = features[:, start : start + count]
            start += count
            scores = drafter.draft_scores(target, int(prompt[0, start]), start, new, cache, num_drafts=4)
            outputs.append(scores.logits.clone())
    block = drafter.config.block_size
    return [*outputs, cache.keys[:, :, :, : cache.length + block].clone(),
            cache.values[:, :, :, : cache.length + block].clone()]


def assert_native_is_python(target: CausalLM, drafter: DFlashDrafter, monkeypatch: pytest.MonkeyPatch) -> None:
    python = rounds(target, drafter, False, monkeypatch)
    native = rounds(target, drafter, True, monkeypatch)
    assert drafter_runs_natively(drafter), "the native calls did not take this drafter"
    assert_bitwise_equal(python, native)


@needs_int8
@pytest.mark.parametrize("products", ["int8", "int8x2"])
def test_the_cpu_drafter_natively_is_its_python_layers(
    engine: Engine, products: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    drafter = engine.drafter
    assert isinstance(drafter, DFlashDrafter)
    use_cpu_matmul(drafter, products)
    try:
        assert_native_is_python(engine.target, drafter, monkeypatch)
    finally:
        use_cpu_matmul(drafter, "int8")


def test_a_quantized_golden_drafter_natively_is_its_python_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    """The golden tiny pair's drafter as Q8_0 blocks with joined projections on the float32 kernel."""
    target, shared = golden_pair()
    drafter = copy.deepcopy(shared)  # the pair is shared by every test of the process
    assert quantize_drafter(drafter) > 0
    use_cpu_matmul(drafter, "float32")
    assert_native_is_python(target, drafter, monkeypatch)


def test_a_drafter_without_joined_projections_keeps_its_python_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    target, shared = golden_pair()
    drafter = copy.deepcopy(shared)  # dense, projections not joined: the Python layers' other path
    monkeypatch.setenv(NATIVE, "1")
    rounds(target, drafter, True, monkeypatch)
    assert drafter_runs_natively(drafter) is False


def test_a_plan_follows_the_modules_it_describes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A plan made before the drafter was quantized (Python layers) is rebuilt after (`layers_changed`), and a copy
    of a model with a plan builds its own, computing what the original computes."""
    target, shared = golden_pair()
    drafter = copy.deepcopy(shared)
    rounds(target, drafter, True, monkeypatch)
    assert drafter_runs_natively(drafter) is False  # dense, projections not joined
    quantize_drafter(drafter)
    use_cpu_matmul(drafter, "float32")
    rounds(target, drafter, True, monkeypatch)
    assert drafter_runs_natively(drafter)
    ids = torch.arange(7)[None]
    with torch.inference_mode():
        want = target(ids, cache=target.new_cache(8)).logits
    assert runs_natively(target)  # the dense golden target
    twin = copy.deepcopy(target)
    assert runs_natively(twin) is None
    with torch.inference_mode():
        got = twin(ids, cache=twin.new_cache(8)).logits
    assert want is not None and got is not None and torch.equal(want, got)
    assert runs_natively(twin)


def test_the_model_code_imports_without_gguf() -> None:
    """Dense models (the GPU's random-weight studies) run where gguf is not installed: describing layers for the
    native calls must not import the quantized modules."""
    code = "import sys; sys.modules['gguf'] = None; import dflash.models.model, dflash.drafter.model"
    subprocess.run([sys.executable, "-c", code], check=True)
