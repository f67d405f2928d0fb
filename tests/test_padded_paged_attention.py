"""The padded passes (`dflash.batch.padded`, `dflash.batch.fused_padded`) attending over the K/V pool in place
(`dflash.kernels.triton_paged_attention`) give what they give when each request's keys are gathered for SDPA
(DFLASH_PADDED_ATTENTION=gather); on the CPU without Triton's interpreter the gather stays."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from dflash import environment
from dflash.batch import fused_padded, padded
from dflash.batch.padded import PaddedBatch, PaddedShape
from dflash.batch.target_pass import TargetRows
from dflash.kernels.triton_decode import interpreting, triton_available
from dflash.kernels.triton_paged_attention import paged_attention_usable
from tests.batch_helpers import drain, make_core, make_sequence, plain_core_with_tree_plain_chain
from tests.spec_helpers import golden_pair, one_torch_thread, random_prompts, run

_one_thread = one_torch_thread  # autouse, module scope

# the models here are on the CPU, where the program runs only under the interpreter (its GPU runs are tested in
# tests/test_triton_paged_attention.py and by the graphed padded core's tests)
runnable = pytest.mark.skipif(
    not (triton_available() and interpreting()), reason="needs Triton's interpreter (TRITON_INTERPRET=1)"
)


def test_the_in_place_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    """On by default where the program runs and head_dim is a power of two of at least 16; the switch opts out; the
    CPU without the interpreter keeps the gather."""
    monkeypatch.delenv(environment.PADDED_ATTENTION, raising=False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert paged_attention_usable(torch.device("cpu"), 64) == triton_available()
    assert not paged_attention_usable(torch.device("cpu"), 48)
    assert not paged_attention_usable(torch.device("cpu"), 8)
    monkeypatch.setenv(environment.PADDED_ATTENTION, "gather")
    assert not paged_attention_usable(torch.device("cpu"), 64)
    monkeypatch.setenv(environment.PADDED_ATTENTION, "paged")
    monkeypatch.delenv("TRITON_INTERPRET")
    assert not paged_attention_usable(torch.device("cpu"), 64)
    assert paged_attention_usable(torch.device("cuda"), 128) == triton_available()


def _counting(module: Any, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the calls of `module.paged_attention` (one entry per call)."""
    calls: list[int] = []
    program = module.paged_attention

    def counted(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(1)
        return program(*args, **kwargs)

    monkeypatch.setattr(module, "paged_attention", counted)
    return calls


def _decoding_items(device: torch.device) -> tuple[Any, Any, list[TargetRows]]:
    """The tiny target on `device` with three decoding requests (one past 256 keys: two key slices) and their
    step's rows: a 7-node tree, a plain step and a 3-row chain."""
    target, _ = golden_pair(str(device))
    prompts = random_prompts(3, target.config.vocab_size, seed=41, lengths=(9, 300, 20))
    core, items = plain_core_with_tree_plain_chain(target, prompts, tree_seed=3)
    return target, core, items


@runnable
@pytest.mark.parametrize("fused", [False, True], ids=["module", "fused"])
def test_the_padded_pass_in_place_equals_the_gather(fused: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tree, a plain step and a chain in one padded batch with a padding request: the pass through the paged
    program (which it does take) gives the gather's logits and features on every real row (fp32), and every row,
    padding included, stays finite."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    target, core, items = _decoding_items(device)
    calls = _counting(fused_padded if fused else padded, monkeypatch)
    forward: Callable[..., tuple[torch.Tensor, torch.Tensor | None]] = (
        fused_padded.fused_padded_forward if fused else padded.padded_forward
    )
    pool = core.target_pool
    capture = (1, len(target.layers) - 1)
    with torch.inference_mode():
        batch = PaddedBatch(PaddedShape.of(items, 4), pool, None)
        assert batch.shape.requests == 4 and batch.shape.keys == 512
        batch.load(items)
        monkeypatch.setenv(environment.PADDED_ATTENTION, "gather")
        gathered_logits, gathered_features = forward(target, pool, batch, capture)
        assert not calls
        monkeypatch.setenv(environment.PADDED_ATTENTION, "paged")
        logits, features = forward(target, pool, batch, capture)
    assert len(calls) == len(target.layers)
    assert torch.isfinite(logits).all()
    for index, item in enumerate(items):
        n = int(item.tokens.numel())
        torch.testing.assert_close(logits[index, :n], gathered_logits[index, :n], atol=1e-4, rtol=1e-4)
        assert features is not None and gathered_features is not None
        torch.testing.assert_close(features[index, :n], gathered_features[index, :n], atol=1e-4, rtol=1e-4)


@runnable
def test_the_eager_padded_core_in_place_gives_each_request_its_tokens_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA path's core run eagerly, its target and drafter passes attending through the paged program: plain,
    linear and DDTree requests of different lengths, joining while others decode, each get their tokens alone."""
    monkeypatch.delenv(environment.PADDED_ATTENTION, raising=False)
    calls = _counting(padded, monkeypatch)
    target, drafter = golden_pair()
    prompts = random_prompts(4, target.config.vocab_size, seed=29, lengths=(7, 70, 30))
    references = [run(target, None, prompt, 16)[0] for prompt in prompts]
    core = make_core(target, drafter, max_batch=4, prefill_chunk=32, eager_padded=True)
    seqs = [make_sequence(target, prompt, 16, ("none", "linear", "ddtree")[i % 3]) for i, prompt in enumerate(prompts)]
    for seq in seqs[:2]:
        core.add(seq)
    core.step()
    for seq in seqs[2:]:
        core.add(seq)
    drain(core)
    assert calls
    for seq, reference in zip(seqs, references, strict=True):
        assert seq.error is None
        assert seq.sink.token_ids == reference, seq.mode
