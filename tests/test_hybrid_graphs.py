"""A hybrid (Gated DeltaNet) target through the graph runner: its linear-attention state in fixed buffers
(`dflash.kv.static_recurrent`), forwards that never change what they read, commits and rollbacks on the host.
On the CPU the runner's static forwards run eagerly (what a CUDA graph would capture); on a GPU they replay."""

from __future__ import annotations

import pytest
import torch

from dflash.errors import GenerationError
from dflash.fastpath.runner import attach_graph_runner
from dflash.generation.forwards import register_forwards
from dflash.kv.static_recurrent import StaticRecurrentStates
from dflash.models.gated_deltanet import new_recurrent_states
from dflash.models.model import CausalLM
from tests.hybrid_models import hf_tiny_hybrid, ours_from_hf_hybrid
from tests.spec_helpers import one_torch_thread, random_prompts
from tests.test_fastpath import generate
from tests.test_hybrid_spec import VOCAB, _drafter

_threads = one_torch_thread


@pytest.fixture(scope="module")
def target() -> CausalLM:
    return ours_from_hf_hybrid(hf_tiny_hybrid(seed=11))


def _filled(target: CausalLM, static: bool, prompt: torch.Tensor) -> tuple[object, torch.Tensor]:
    """A cache of `target` with the given kind of states, `prompt` forwarded: (cache, last logits)."""
    cache = target.new_cache(64)
    cache.recurrent = new_recurrent_states(target.config, target.embed_tokens.weight, static=static)
    logits = target(prompt, cache=cache).logits
    assert logits is not None
    return cache, logits[0, -1]


@torch.no_grad()
def test_static_states_roll_back_as_the_eager_ones_do(target: CausalLM) -> None:
    """Crops into a forward, a kept tree path, whole commits and snapshots leave the static buffers where the
    eager states are: the next step's logits agree."""
    prompt = torch.tensor([random_prompts(1, VOCAB, seed=3, lengths=(11,))[0]])
    block = torch.tensor([[5, 9, 14, 2, 7]])
    parents = [-1, 0, 0, 2]
    mask = torch.eye(4, dtype=torch.bool)
    for row, parent in enumerate(parents):
        while parent >= 0:
            mask[row, parent] = True
            parent = parents[parent]
    follow = torch.tensor([[33]])
    for cut in ("crop 3", "crop all", "tree"):
        results = []
        for static in (False, True):
            cache, _ = _filled(target, static, prompt)
            if cut == "tree":
                positions = torch.tensor([[11, 12, 12, 13]])
                target(block[:, :4], positions, cache, tree_mask=mask)
                cache.compact(11, torch.tensor([11, 13, 14]))  # rows 0, 2, 3: a path that skips row 1
            else:
                target(block, cache=cache)
                cache.crop(11 + (3 if cut == "crop 3" else 5))
            logits = target(follow, cache=cache).logits
            assert logits is not None
            results.append(logits)
        torch.testing.assert_close(results[1], results[0], rtol=1e-5, atol=1e-5, msg=cut)


@torch.no_grad()
def test_static_states_refuse_what_they_cannot_replay(target: CausalLM) -> None:
    prompt = torch.tensor([random_prompts(1, VOCAB, seed=4, lengths=(9,))[0]])
    cache, _ = _filled(target, True, prompt)
    recurrent = cache.recurrent  # type: ignore[attr-defined]
    assert isinstance(recurrent, StaticRecurrentStates)
    target(torch.tensor([[3]]), cache=cache)
    with pytest.raises(GenerationError, match="roll back"):
        recurrent.crop(5)  # before the last forward
    mask = torch.ones(2, 2, dtype=torch.bool).tril()
    target(torch.tensor([[3, 4]]), torch.tensor([[9, 10]]), cache, tree_mask=mask)
    with pytest.raises(GenerationError, match="cut to one path"):
        target(torch.tensor([[3]]), cache=cache)  # a tree left uncut


@pytest.mark.parametrize("mode", ["none", "linear", "ddtree:8"])
def test_generation_through_the_runner_equals_eager(target: CausalLM, mode: str) -> None:
    """Every strategy through the runner's static forwards (prompt chunks padded past their rows, verifications,
    trees) gives the eager tokens, which are the plain greedy ones; the runner served the target."""
    drafter = _drafter()
    prompts = random_prompts(2, VOCAB, seed=6, lengths=(13, 45))
    eager = [generate(target, drafter, mode, p, 30) for p in prompts]
    plain = [generate(target, drafter, "none", p, 30) for p in prompts]
    runner = attach_graph_runner(target, drafter, capacity=256, capture=False)
    try:
        static = [generate(target, drafter, mode, p, 30) for p in prompts]
    finally:
        register_forwards(target, None)
    assert static == eager == plain
    assert runner.served > 30 and runner.max_rows == 64
    assert isinstance(runner.target_storage.recurrent, StaticRecurrentStates)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("mode", ["none", "linear", "ddtree:8"])
def test_cuda_graphs_of_a_hybrid_give_the_plain_tokens(mode: str) -> None:
    """float32 on the GPU: replayed graphs (the delta rule's program, commits and rollbacks in fixed buffers)
    give the eager plain greedy tokens over prompts longer than a graph's rows."""
    target = ours_from_hf_hybrid(hf_tiny_hybrid(seed=11)).to("cuda")
    drafter = _drafter().to("cuda")
    prompts = random_prompts(3, VOCAB, seed=8, lengths=(9, 70, 200))
    plain = [generate(target, drafter, "none", p, 120) for p in prompts]
    runner = attach_graph_runner(target, drafter, capacity=1024)
    try:
        graphed = [generate(target, drafter, mode, p, 120) for p in prompts]
    finally:
        register_forwards(target, None)
    assert graphed == plain
    assert runner.captured > 0 and runner.served > 20


@pytest.mark.parametrize("speculative", [False, True])
def test_the_prefix_cache_resumes_the_runner_s_fixed_state(target: CausalLM, speculative: bool) -> None:
    """Through the runner's static forwards, blocks keep copies of the fixed buffers' state at their end and a hit
    restores them: a prompt sharing a cached prefix decodes exactly as a cold prefill does."""
    from dflash.kv.prefix_cache import PrefixCache
    from tests.test_hybrid_spec import _with_prefix_cache

    drafter = _drafter() if speculative else None
    layers = drafter.config.target_layer_ids if drafter is not None else ()
    first = random_prompts(1, VOCAB, seed=12, lengths=(30,))[0]
    second = first[:21] + random_prompts(1, VOCAB, seed=15, lengths=(12,))[0]  # shares 2 blocks and 5 tokens
    cold = {tuple(p): _with_prefix_cache(target, drafter, p, None, 12)[0] for p in (first, second)}
    runner = attach_graph_runner(target, drafter, capacity=256, capture=False)
    try:
        prefix_cache = PrefixCache(2**24, block_tokens=8, feature_layers=layers)
        assert _with_prefix_cache(target, drafter, first, prefix_cache, 12) == (cold[tuple(first)], 0)
        assert _with_prefix_cache(target, drafter, first, prefix_cache, 12) == (cold[tuple(first)], 24)
        assert _with_prefix_cache(target, drafter, second, prefix_cache, 12) == (cold[tuple(second)], 16)
    finally:
        register_forwards(target, None)
    assert runner.served > 10
