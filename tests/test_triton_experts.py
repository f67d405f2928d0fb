"""The routed-expert programs (`dflash.kernels.triton_experts`) against the per-expert loop, and a mixture decoding
through them."""

from __future__ import annotations

import pytest
import torch

from dflash.kernels import triton_experts
from dflash.kernels.triton_experts import routed_experts
from dflash.kernels.triton_tree import tree_kernel_usable
from dflash.models.moe import StackedExperts

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
needs_triton = pytest.mark.skipif(not tree_kernel_usable(DEVICE), reason="needs Triton (a GPU, or TRITON_INTERPRET=1)")


@needs_triton
@pytest.mark.parametrize("tokens", [1, 3, 4])
def test_routed_programs_give_the_per_expert_loop_s_mix(tokens: int) -> None:
    """Widths and hidden sizes that are not multiples of the programs' blocks; a token choosing the same expert as
    another; float32."""
    generator = torch.Generator().manual_seed(tokens)
    experts = StackedExperts(6, 48, 40, "silu")
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(experts.gate_up_proj.shape, generator=generator) * 0.2)
        experts.down_proj.copy_(torch.randn(experts.down_proj.shape, generator=generator) * 0.2)
    experts = experts.to(DEVICE)
    x = torch.randn(tokens, 48, generator=generator).to(DEVICE)
    chosen = torch.stack([torch.randperm(6, generator=generator)[:3] for _ in range(tokens)]).to(DEVICE)
    chosen[-1, 0] = chosen[0, 0]  # a shared expert between the first and the last token
    weights = torch.rand(tokens, 3, generator=generator).to(DEVICE)
    with torch.no_grad():
        reference = experts.cpu()(x.cpu(), chosen.cpu(), weights.cpu())  # float32 on the CPU: the per-expert loop
        experts.to(DEVICE)
        out = routed_experts(x, chosen, weights, experts.gate_up_proj, experts.down_proj)
    torch.testing.assert_close(out.cpu(), reference, rtol=1e-5, atol=1e-5)
    alone = routed_experts(x[:1], chosen[:1], weights[:1], experts.gate_up_proj, experts.down_proj)
    assert torch.equal(alone[0], out[0])  # a token's result does not depend on the other tokens


@needs_triton
def test_a_mixture_decodes_through_the_programs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiny Qwen3-MoE's steps through the programs (interpreted on the CPU, forced where the grouped product
    would not serve): the same logits as the per-expert loop, and linear DFlash gives plain decoding's tokens."""
    from tests.family_checks import tiny_drafter
    from tests.spec_helpers import random_prompts, run
    from tests.test_qwen3_moe import hf_moe
    from tests.tiny_models import ours_from_hf

    model = ours_from_hf(hf_moe()).to(DEVICE)  # its own copy: the other tests' cached model stays on the CPU
    prompt = random_prompts(1, model.config.vocab_size, seed=4, lengths=(12,))[0]
    reference, _ = run(model, None, prompt, 8, prefill_chunk=16)
    calls = 0
    original = triton_experts.routed_experts

    def counted(*args: torch.Tensor) -> torch.Tensor:
        nonlocal calls
        calls += 1
        return original(*args)

    monkeypatch.setattr(triton_experts, "SERVES_INTERPRETED", True)
    monkeypatch.setattr(triton_experts, "routed_experts", counted)
    plain, _ = run(model, None, prompt, 8, prefill_chunk=16)
    assert plain == reference and calls > 0
    drafter = tiny_drafter(model.config.vocab_size, 4, [1, 2], block=4).to(DEVICE)  # verifications of 4 rows
    assert run(model, drafter, prompt, 8, prefill_chunk=16)[0] == plain


@needs_triton
@pytest.mark.parametrize("normalise", [True, False])
def test_the_routing_program_chooses_as_the_router_does(normalise: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Softmax, top-k in descending order and the rescaling, against the torch routing of `SparseMoeBlock`."""
    from dflash.models.moe import SparseMoeBlock
    from tests.test_qwen3_moe import hf_moe
    from tests.tiny_models import ours_from_hf

    block = ours_from_hf(hf_moe()).layers[0].mlp
    assert isinstance(block, SparseMoeBlock)
    block.normalise = normalise
    block = block.to(DEVICE)
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    with torch.no_grad():
        chosen, weights = block.route(x)
        monkeypatch.setattr(triton_experts, "SERVES_INTERPRETED", True)
        logits = block.gate(x)
        assert triton_experts.route_program_serves(logits) or DEVICE.type == "cuda"
        program_chosen, program_weights = triton_experts.route_rows(logits, block.top_k, normalise)
    assert torch.equal(program_chosen, chosen)
    torch.testing.assert_close(program_weights, weights, rtol=1e-6, atol=1e-6)
