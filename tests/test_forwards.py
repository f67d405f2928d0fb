"""Who runs the models' forwards: the decoding side chooses (`dflash.generation.forwards`), the models never know.

The models and the drafter import nothing of the GPU fast path; a graph runner is attached by registering
`GraphForwards` for its target, the loops use what is registered unless given forwards explicitly, and the
registry keeps no model alive.
"""

from __future__ import annotations

import ast
import gc
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch

import dflash
from dflash.drafter.model import DFlashDrafter
from dflash.fastpath.dispatch import GraphForwards, graph_runner_of
from dflash.fastpath.runner import GraphRunner, attach_graph_runner
from dflash.generation.autoregressive import decode_autoregressive
from dflash.generation.forwards import EAGER, forwards_for, register_forwards
from dflash.generation.output import OutputSink
from dflash.generation.request import GenerationRequest
from dflash.generation.sampling import SamplingParams
from dflash.generation.selection import TokenChooser
from dflash.models.model import CausalLM
from dflash.speculative.linear import decode_linear
from tests.spec_helpers import golden_pair, random_prompts
from tests.tiny_models import hf_tiny, ours_from_hf

PACKAGE = Path(dflash.__file__).parent
MODEL_SOURCES = [*sorted((PACKAGE / "models").glob("*.py")), PACKAGE / "drafter" / "model.py"]


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, at the top, inside functions or under TYPE_CHECKING alike."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module is not None and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


@pytest.mark.parametrize("path", MODEL_SOURCES, ids=lambda path: f"{path.parent.name}/{path.name}")
def test_models_do_not_import_the_fast_path(path: Path) -> None:
    fast_path = {name for name in imported_modules(path) if name == "dflash.fastpath" or name.startswith("dflash.fastpath.")}
    assert not fast_path, f"{path.name} imports {sorted(fast_path)}"


def test_loading_the_models_loads_no_fast_path() -> None:
    """What they import, directly or not: building and loading a model and its drafter needs no fast path."""
    modules = [f"dflash.models.{path.stem}" for path in MODEL_SOURCES if path.parent.name == "models"]
    code = (
        f"import sys\nfor name in {[*modules, 'dflash.drafter.model', 'dflash.drafter.loader']!r}:\n"
        "    __import__(name)\n"
        "print(sorted(m for m in sys.modules if m.startswith('dflash.fastpath')))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_the_import_check_sees_the_fast_path(tmp_path: Path) -> None:
    source = tmp_path / "example.py"
    source.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from dflash.fastpath.runner import GraphRunner\n")
    assert "dflash.fastpath.runner" in imported_modules(source)
    source.write_text("def f():\n    import dflash.fastpath.resident\n")
    assert "dflash.fastpath.resident" in imported_modules(source)


def test_models_hold_no_graph_runner() -> None:
    target, drafter = golden_pair()
    runner = attach_graph_runner(target, drafter, capacity=256, capture=False)
    try:
        assert graph_runner_of(target) is runner
        assert not any("runner" in name for name in (*vars(target), *vars(drafter)))
    finally:
        register_forwards(target, None)
    assert graph_runner_of(target) is None and forwards_for(target) is EAGER


def greedy_linear(
    target: CausalLM, drafter: DFlashDrafter, prompt: list[int], max_new: int, **kwargs: object
) -> list[int]:
    request = GenerationRequest(prompt_ids=prompt, max_new_tokens=max_new)
    sink = OutputSink(lambda ids: "", eos_ids=(), max_new_tokens=max_new)
    chooser = TokenChooser(SamplingParams(), eos_ids=(), min_tokens=0, vocab_size=target.config.vocab_size,
                           device="cpu")
    decode_linear(target, drafter, request, sink, chooser, prefill_chunk=32, **kwargs)  # type: ignore[arg-type]
    return sink.token_ids


def test_forwards_given_to_a_loop_override_the_registered_ones() -> None:
    """A runner serves a loop given its `GraphForwards` without being registered, and a loop given the eager
    forwards ignores a registered runner; the tokens are the same either way."""
    target, drafter = golden_pair()
    prompt = random_prompts(1, target.config.vocab_size, seed=41, lengths=(20,))[0]
    eager = greedy_linear(target, drafter, prompt, 30)
    runner = GraphRunner(target, drafter, capacity=512, capture=False)
    assert greedy_linear(target, drafter, prompt, 30, forwards=GraphForwards(runner)) == eager
    assert runner.served > 0 and runner.residents  # the prefill graphs, then the resident rounds
    assert forwards_for(target) is EAGER

    registered = attach_graph_runner(target, drafter, capacity=512, capture=False)
    try:
        assert greedy_linear(target, drafter, prompt, 30, forwards=EAGER) == eager
        assert registered.served == 0
    finally:
        register_forwards(target, None)


def test_graph_forwards_leave_other_models_eager() -> None:
    """Another target of the same shape gets its own cache and eager forwards, never the runner's storage."""
    target = ours_from_hf(hf_tiny("llama"))
    other = ours_from_hf(hf_tiny("llama", seed=1))
    forwards = GraphForwards(GraphRunner(target, None, capacity=256, capture=False))
    assert forwards.new_target_cache(target, 100).shares_memory_with(forwards.runner.target_storage)
    cache = forwards.new_target_cache(other, 100)
    assert not cache.shares_memory_with(forwards.runner.target_storage)
    with torch.inference_mode():
        out = forwards.forward(other, torch.tensor([[1, 2, 3]]), cache=cache)
    assert forwards.runner.served == 0 and out.logits is not None and cache.length == 3
    assert forwards.resident(other, TokenChooser(SamplingParams(), eos_ids=(), min_tokens=0, vocab_size=512,
                                                 device="cpu"), cache) is None


def test_the_registry_keeps_no_model_alive() -> None:
    """An engine that is dropped without detaching its runner frees its target (and the runner's storage)."""
    target = ours_from_hf(hf_tiny("llama"))
    runner = attach_graph_runner(target, None, capacity=128, capture=False)
    target_ref, runner_ref = weakref.ref(target), weakref.ref(runner)
    del target, runner
    gc.collect()
    assert target_ref() is None and runner_ref() is None


def test_plain_decoding_through_registered_forwards() -> None:
    target, drafter = golden_pair()
    prompt = random_prompts(1, target.config.vocab_size, seed=42, lengths=(12,))[0]
    request = GenerationRequest(prompt_ids=prompt, max_new_tokens=8, sampling=SamplingParams(temperature=0.7, seed=3))
    results = []
    for attached in (False, True):
        runner = attach_graph_runner(target, drafter, capacity=256, capture=False) if attached else None
        try:
            sink = OutputSink(lambda ids: "", eos_ids=(), max_new_tokens=8)
            chooser = TokenChooser(request.sampling, eos_ids=(), min_tokens=0, vocab_size=target.config.vocab_size,
                                   device="cpu")
            decode_autoregressive(target, request, sink, chooser, prefill_chunk=32)
            results.append(sink.token_ids)
        finally:
            register_forwards(target, None)
        if runner is not None:  # sampling keeps the host loop: every step went through the runner's forward
            assert runner.served == 1 + 7 and not runner.residents
    assert results[0] == results[1]
