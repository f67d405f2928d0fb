"""The native decoder layers (`dflash.models.native_stack`, `kernels/cpu_decoder.cpp`) compute bitwise what the
Python layers compute: logits, captured features and every cache slot, for decode steps, tree verifications and
short prompts, on each products kind (int8x2, int8, float32; AMX where the CPU has it) and dense float32 weights
with biases; they step aside where they do not apply, and a products change is picked up."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import dflash.models.model as model_module
from dflash.batch.target_pass import run_target
from dflash.bench.random_gguf import write_random_gguf
from dflash.engine.engine import EngineOptions
from dflash.engine.loading import load_engine
from dflash.models.cpu_matmul import amx_obstacle, use_cpu_matmul
from dflash.models.model import CausalLM, ForwardOutput
from dflash.models.native_stack import native_layers, runs_natively
from dflash.models.quantized_layers import QuantizedStack
from dflash.models.quantized_model import build_quantized_model
from dflash.models.resolve import load_checkpoint
from dflash.speculative.gate import GateCosts
from tests.batch_helpers import decoding_core, mixed_target_rows
from tests.spec_helpers import one_torch_thread
from tests.test_int8_kernel import needs_int8
from tests.test_quantized_model import mixed_types, requantized_tiny_gguf
from tests.tiny_models import hf_tiny, ours_from_hf

_one_thread = one_torch_thread  # autouse, module scope
NATIVE = "DFLASH_CPU_NATIVE_LAYERS"


@pytest.fixture(autouse=True)
def _no_gguf_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DFLASH_NO_CACHE", "1")


@pytest.fixture(scope="module")
def q4_k_m_model(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CausalLM]:
    """The bench's tiny random Qwen3 in Q4_K_M: q/k norms, a QuantizedStack (Q4_K q/k beside Q6_K v)."""
    path = write_random_gguf(tmp_path_factory.mktemp("native") / "tiny-q4_k_m.gguf", "tiny", "q4_k_m")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DFLASH_NO_CACHE", "1")
        model = build_quantized_model(load_checkpoint(path, weights="quantized")).eval()
    yield model


def session(model: CausalLM, native: bool, monkeypatch: pytest.MonkeyPatch) -> list[torch.Tensor]:
    """A prompt, three plain steps and a 5-node tree verification, then two more steps, native or not ->
    every forward's logits and features, and the cache's slots at the end."""
    monkeypatch.setenv(NATIVE, "1" if native else "0")
    config = model.config
    generator = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, config.vocab_size, (1, 11), generator=generator)
    cache = model.new_cache(64)
    capture = (0, config.num_layers - 1)
    outputs: list[ForwardOutput] = []
    with torch.inference_mode():
        outputs.append(model(prompt, cache=cache, capture=capture))
        for token in (5, 17, 2):
            outputs.append(model(torch.tensor([[token]]), cache=cache, capture=capture))
        start = cache.length
        tree = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 0, 1, 0, 1]])
        depth = torch.tensor([0, 1, 1, 2, 2])
        nodes = torch.tensor([[7, 8, 9, 10, 11]])
        outputs.append(model(nodes, positions=(start + depth)[None], cache=cache, tree_mask=tree.bool(), capture=capture))
        cache.compact(start, torch.tensor([start, start + 2, start + 4]))
        for token in (4, 6):
            outputs.append(model(torch.tensor([[token]]), cache=cache, capture=capture))
    tensors = [t for out in outputs for t in (out.logits, out.features) if t is not None]
    return [*tensors, cache.keys[:, :, :, : cache.length].clone(), cache.values[:, :, :, : cache.length].clone()]


def assert_bitwise_equal(python: list[torch.Tensor], native: list[torch.Tensor]) -> None:
    assert len(python) == len(native)
    for index, (want, got) in enumerate(zip(python, native, strict=True)):
        assert torch.equal(want, got), f"tensor {index} differs"


def assert_native_is_python(model: CausalLM, monkeypatch: pytest.MonkeyPatch) -> None:
    python = session(model, False, monkeypatch)
    native = session(model, True, monkeypatch)
    assert runs_natively(model), "the native layers did not take this model"
    assert_bitwise_equal(python, native)


@needs_int8
@pytest.mark.parametrize("products", ["int8x2", "int8"])
def test_native_layers_are_the_python_layers_on_int8_products(
    q4_k_m_model: CausalLM, products: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    use_cpu_matmul(q4_k_m_model, products)
    assert any(isinstance(m, QuantizedStack) for m in q4_k_m_model.modules())
    assert_native_is_python(q4_k_m_model, monkeypatch)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_native_layers_are_the_python_layers_on_the_float32_kernel(
    tmp_path: Path, arch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = build_quantized_model(load_checkpoint(requantized_tiny_gguf(tmp_path, arch, mixed_types), weights="quantized"))
    use_cpu_matmul(model, "float32")
    assert_native_is_python(model.eval(), monkeypatch)


@pytest.mark.skipif(amx_obstacle() is not None, reason="no AMX tiles on this CPU")
def test_native_layers_are_the_python_layers_on_amx_tiles(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = build_quantized_model(load_checkpoint(requantized_tiny_gguf(tmp_path, "llama", mixed_types), weights="quantized"))
    use_cpu_matmul(model, "amx")
    assert_native_is_python(model.eval(), monkeypatch)


def test_native_layers_are_the_python_layers_with_dense_weights_and_biases(monkeypatch: pytest.MonkeyPatch) -> None:
    model = ours_from_hf(hf_tiny("llama", seed=4, attention_bias=True)).eval()
    assert model.layers[0].self_attn.qkv_proj.bias is not None
    assert_native_is_python(model, monkeypatch)


@needs_int8
def test_a_products_change_rebuilds_the_native_layers(q4_k_m_model: CausalLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """A description kept from int8x2 products would give int8x2 values after the switch to int8."""
    use_cpu_matmul(q4_k_m_model, "int8x2")
    on_int8x2 = session(q4_k_m_model, True, monkeypatch)
    use_cpu_matmul(q4_k_m_model, "int8")
    assert_native_is_python(q4_k_m_model, monkeypatch)
    assert not torch.equal(on_int8x2[0], session(q4_k_m_model, True, monkeypatch)[0])


def test_the_native_layers_step_aside_where_they_do_not_apply(monkeypatch: pytest.MonkeyPatch) -> None:
    model = ours_from_hf(hf_tiny("llama", seed=5)).eval()
    hidden, head_dim = model.config.hidden_size, model.config.head_dim
    cache = model.new_cache(128)
    cos, sin = model.rotary.cos_sin(torch.arange(3)[None], torch.float32)
    x = torch.randn(1, 3, hidden)
    with torch.no_grad():
        assert native_layers(model, x, cos, sin, None, cache, ()) is not None
        assert native_layers(model, x, cos, sin, None, None, ()) is None  # no cache
        assert native_layers(model, x.double(), cos, sin, None, cache, ()) is None
        long_cos, long_sin = model.rotary.cos_sin(torch.arange(65)[None], torch.float32)
        assert native_layers(model, torch.randn(1, 65, hidden), long_cos, long_sin, None, cache, ()) is None
        assert native_layers(model, x, cos, sin, torch.zeros(1, 3, 3), cache, ()) is None  # a float mask
        handle = model.layers[1].mlp.down_proj.register_forward_hook(lambda *args: None)  # hooks must fire
        assert native_layers(model, x, cos, sin, None, cache, ()) is None
        handle.remove()
        assert native_layers(model, x, cos, sin, None, cache, ()) is not None
        monkeypatch.setenv(NATIVE, "0")
        assert native_layers(model, x, cos, sin, None, cache, ()) is None
    monkeypatch.setenv(NATIVE, "1")
    assert native_layers(model, x, cos, sin, None, cache, ()) is None  # autograd on
    gemma = ours_from_hf(hf_tiny("gemma3", seed=5)).eval()
    with torch.no_grad():
        assert native_layers(gemma, x[..., : gemma.config.hidden_size], cos[..., :head_dim], sin[..., :head_dim],
                             None, gemma.new_cache(16), ()) is None
    assert runs_natively(gemma) is False


@needs_int8
def test_a_cpu_engine_warm_up_builds_the_native_layers_before_the_first_request() -> None:
    """On the CPU `warm_up` runs a short generation: the kernels compile and the layers are described then, and
    the speculation gate's round times start afresh (not from a run that paid for compiling)."""
    engine = load_engine("default", options=EngineOptions(max_batch=1, spec="ddtree"))
    assert runs_natively(engine.target) is None
    before = engine.gate_costs
    assert engine.warm_up() == 0
    assert runs_natively(engine.target)
    assert engine.gate_costs is not None and before is not None
    assert all(engine.gate_costs[mode] is not before[mode] for mode in before)
    assert all(costs == GateCosts() for costs in engine.gate_costs.values())


def test_native_layers_are_the_python_layers_over_the_batched_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    """A packed forward of the batched core (a plain step, a 4-row chain, a 7-node tree): logits, features and the
    pool's written slots bitwise the same natively and from Python, and the native call took it."""
    target, _, core, seqs = decoding_core()
    items = mixed_target_rows(target, seqs)
    taken: list[bool] = []

    def recorded(*args: object) -> object:
        out = native_layers(*args)  # type: ignore[arg-type]
        taken.append(out is not None)
        return out

    monkeypatch.setattr(model_module, "native_layers", recorded)
    written = torch.cat([seq.target.slots(seq.target.length, seq.target.length + item.count)
                         for seq, item in zip(seqs, items, strict=True)])
    results = []
    for flag in ("0", "1"):
        monkeypatch.setenv(NATIVE, flag)
        with torch.inference_mode():
            out = run_target(target, core.target_pool, items, core.capture)
        assert out.features is not None
        pool = core.target_pool
        results.append([*out.logits, *out.features, pool.keys[:, :, written].clone(), pool.values[:, :, written].clone()])
    assert taken == [False, True]
    for want, got in zip(*results, strict=True):
        assert torch.equal(want, got)
