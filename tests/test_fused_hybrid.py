"""The graph runner's fused hybrid forward (`dflash.fastpath.fused_hybrid`) against its unfused static forward, and
decoding through it: rollbacks and trees keep speculative greedy tokens equal to plain ones."""

from __future__ import annotations

import pytest
import torch

from dflash.fastpath.fused_hybrid import supports_fused_hybrid
from dflash.fastpath.runner import GraphRunner, attach_graph_runner
from dflash.generation.forwards import register_forwards
from dflash.kernels.triton_delta_rule import delta_rule_program_usable
from dflash.kv.static_recurrent import StaticRecurrentStates
from dflash.models.model import CausalLM
from tests.hybrid_models import hf_tiny_hybrid, ours_from_hf_hybrid
from tests.spec_helpers import random_prompts
from tests.test_fastpath import generate
from tests.test_hybrid_spec import VOCAB, _drafter

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
needs_programs = pytest.mark.skipif(
    not delta_rule_program_usable(torch.empty(0, device=DEVICE)), reason="needs Triton (a GPU, or TRITON_INTERPRET=1)"
)


def _target() -> CausalLM:
    return ours_from_hf_hybrid(hf_tiny_hybrid(seed=11)).to(DEVICE)


def _states(runner: GraphRunner) -> StaticRecurrentStates:
    states = runner.target_storage.recurrent
    assert isinstance(states, StaticRecurrentStates)
    return states


@needs_programs
@torch.inference_mode()
def test_fused_forwards_give_the_static_forward_s_logits_and_states() -> None:
    """Prompt, a 5-row chain cropped to 3, a tree cut to a path, a step: logits, features, K/V rows and the
    committed linear-attention state agree with the unfused static forward (float32); the joined projections
    leave the eager model's own logits unchanged."""
    target = _target()
    assert supports_fused_hybrid(target)
    prompt = torch.tensor([random_prompts(1, VOCAB, seed=6, lengths=(40,))[0]], device=DEVICE)
    before = target(prompt).logits
    plain = GraphRunner(target, None, capacity=256, capture=False, fused=False)
    fused = GraphRunner(target, None, capacity=256, capture=False, fused=True)
    caches = [plain.lease_target_cache(200), fused.lease_target_cache(200)]
    assert caches[0] is not None and caches[1] is not None
    ancestors = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool, device=DEVICE)
    steps = (
        (prompt, None, None, None),
        (torch.tensor([[5, 9, 200, 17, 3]], device=DEVICE), None, None, ("crop", 43)),
        (torch.tensor([[5, 9, 10]], device=DEVICE), torch.tensor([[43, 44, 44]], device=DEVICE), ancestors,
         ("keep", [43, 45])),
        (torch.tensor([[7]], device=DEVICE), None, None, None),
    )
    for ids, positions, mask, cut in steps:
        outs = [
            runner.target_forward(ids, positions, cache, mask, (1, 3), "all")
            for runner, cache in zip((plain, fused), caches, strict=True)
        ]
        assert outs[0] is not None and outs[1] is not None
        torch.testing.assert_close(outs[1].logits, outs[0].logits, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(outs[1].features, outs[0].features, rtol=1e-4, atol=1e-4)
        for cache in caches:
            if cut is not None and cut[0] == "crop":
                cache.crop(cut[1])
            elif cut is not None:
                cache.compact(43, torch.tensor(cut[1], device=DEVICE))
    states = [_states(plain), _states(fused)]
    for state in states:
        state.settle()
    torch.testing.assert_close(states[1].committed_states, states[0].committed_states, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(states[1].committed_windows, states[0].committed_windows, rtol=1e-4, atol=1e-4)
    length = caches[0].length
    assert length == caches[1].length == 40 + 3 + 2 + 1
    torch.testing.assert_close(caches[1].keys[..., :length, :], caches[0].keys[..., :length, :], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(target(prompt).logits, before)


@needs_programs
@pytest.mark.parametrize("mode", ["linear", "ddtree:8"])
def test_speculation_through_the_fused_runner_gives_its_plain_tokens(mode: str) -> None:
    """Plain decoding, linear DFlash and DDTree through the fused hybrid forwards (prompt chunks padded past their
    rows, rollbacks, trees): the same greedy tokens."""
    target, drafter = _target(), _drafter().to(DEVICE)
    runner = attach_graph_runner(target, drafter, capacity=256, capture=False, fused=True)
    try:
        prompt = random_prompts(1, VOCAB, seed=7, lengths=(45,))[0]
        assert generate(target, drafter, mode, prompt, 16) == generate(target, drafter, "none", prompt, 16)
    finally:
        register_forwards(target, None)
    assert runner.fused and runner.served > 10
