"""Gated DeltaNet prompt chunks through flash-linear-attention's kernels (`dflash.kernels.fla_delta_rule`): the same
outputs and states as the torch chunked form, the switch and the fallback, and a hybrid model on a GPU decoding
speculatively as it decodes plainly."""

from __future__ import annotations

import pytest
import torch

from dflash.kernels import fla_delta_rule
from dflash.kernels.fla_delta_rule import fla_chunked_delta_rule, fla_usable
from dflash.models import gated_deltanet
from dflash.models.delta_rule import chunked_delta_rule, recurrent_delta_rule
from tests.hybrid_models import hf_tiny_hybrid, ours_from_hf_hybrid
from tests.spec_helpers import random_prompts, run
from tests.test_hybrid_spec import VOCAB, _drafter

gpu_with_fla = pytest.mark.skipif(
    not torch.cuda.is_available() or fla_delta_rule._chunk_kernel() is None,
    reason="needs a CUDA device and fla-core",
)


def _inputs(batch: int, heads: int, seq: int, key_dim: int, value_dim: int, device: str) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(3)
    q = torch.nn.functional.normalize(torch.randn(batch, heads, seq, key_dim, generator=g), dim=-1) * key_dim**-0.5
    k = torch.nn.functional.normalize(torch.randn(batch, heads, seq, key_dim, generator=g), dim=-1)
    v = torch.randn(batch, heads, seq, value_dim, generator=g)
    decay = -torch.rand(batch, heads, seq, generator=g) * 0.3  # log decays <= 0
    beta = torch.rand(batch, heads, seq, generator=g)
    state = torch.randn(batch, heads, key_dim, value_dim, generator=g) * 0.1
    return tuple(t.to(device) for t in (q, k, v, decay, beta, state))


def test_without_a_gpu_or_when_switched_off_the_torch_form_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    rows = torch.zeros(1, 2, 20, 8)
    assert not fla_usable(rows)  # CPU tensors never take the kernels
    assert gated_deltanet._chunked_rule(rows) is chunked_delta_rule
    if torch.cuda.is_available():
        monkeypatch.setenv("DFLASH_FLA", "0")
        assert not fla_usable(rows.cuda())


@pytest.mark.gpu
@gpu_with_fla
@pytest.mark.parametrize("seq", [17, 64, 200])
def test_the_kernel_gives_the_torch_chunked_outputs_and_state(seq: int) -> None:
    """Outputs and final state against the torch forms (chunked and token by token) from a non-zero state, at
    lengths below, at and past one chunk; the kernels' products run in TF32, hence the tolerance."""
    q, k, v, g, beta, state = _inputs(2, 4, seq, 64, 96, "cuda")
    out, final = fla_chunked_delta_rule(q, k, v, g, beta, state)
    ref_out, ref_final = chunked_delta_rule(q, k, v, g, beta, state)
    step_out, step_final = recurrent_delta_rule(q, k, v, g, beta, state)
    assert out.shape == ref_out.shape and final.shape == ref_final.shape
    for got, want in ((out, ref_out), (final, ref_final), (out, step_out), (final, step_final)):
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@gpu_with_fla
def test_a_hybrid_model_on_the_gpu_prefills_through_the_kernels_and_stays_lossless(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Prompts longer than a prefill chunk through the kernels give the torch form's logits (within TF32), and
    speculative decoding gives the plain greedy tokens (float32)."""
    target = ours_from_hf_hybrid(hf_tiny_hybrid(seed=11)).cuda()
    drafter = _drafter().cuda()
    calls: list[int] = []

    def counted(*args: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append(args[0].shape[2])
        return fla_chunked_delta_rule(*args)

    monkeypatch.setattr(gated_deltanet, "fla_chunked_delta_rule", counted)
    prompt = random_prompts(1, VOCAB, seed=9, lengths=(150,))[0]
    tokens = torch.tensor([prompt], device="cuda")
    with torch.inference_mode():
        with_kernels = target(tokens).logits
        assert calls, "the prompt did not go through the kernels"
        monkeypatch.setenv("DFLASH_FLA", "0")
        torch_form = target(tokens).logits
    torch.testing.assert_close(with_kernels, torch_form, atol=2e-3, rtol=2e-3)
    monkeypatch.delenv("DFLASH_FLA")
    for prompt in random_prompts(2, VOCAB, seed=5, lengths=(90,)):
        plain, _ = run(target, None, prompt, 24)
        spec, stats = run(target, drafter, prompt, 24)
        assert spec == plain and stats.rounds > 0
