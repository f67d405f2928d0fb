"""The drafter's padded block pass through the fused kernels (`fused_padded_drafter_forward`), with each request's new
context rows stored in the same pass, gives the module-by-module pass's logits and pool writes (the context stored
by `store_context`, then `padded_drafter_forward`): float32, under Triton's interpreter on the CPU (the GPU runs it
in the graphed device-tree tests)."""

from __future__ import annotations

import pytest
import torch

from dflash.batch.device_trees import DeviceTrees
from dflash.fastpath.fused_drafter import fuse_drafter_weights, supports_fused_drafter
from dflash.kernels.triton_decode import interpreting, triton_available
from tests.batch_helpers import make_core, make_sequence
from tests.spec_helpers import golden_pair, one_torch_thread, random_prompts

_one_thread = one_torch_thread  # autouse, module scope

runnable = pytest.mark.skipif(
    not (triton_available() and interpreting()), reason="needs Triton's interpreter (TRITON_INTERPRET=1)"
)


@runnable
def test_the_fused_drafter_pass_equals_the_module_pass() -> None:
    """Three requests (a padding request beside them) with 9, 16 and 14 new context rows (a 40-token prompt keeps
    its last block's rows, the rest absorbed before): equal draft logits, equal keys and values in every slot but
    the trash slot (where the module pass sends padding rows and the fused one stores nothing)."""
    target, drafter = golden_pair()
    assert supports_fused_drafter(drafter)
    core = make_core(target, drafter, max_batch=4, prefill_chunk=64, ddtree_budget=6, eager_padded=True)
    trees = core.device_trees
    assert isinstance(trees, DeviceTrees) and trees.fused_drafter is None
    prompts = random_prompts(3, target.config.vocab_size, seed=5, lengths=(9, 40, 14))
    seqs = [make_sequence(target, prompt, 20, "ddtree") for prompt in prompts]
    for seq in seqs:
        core.add(seq)
    while any(seq.phase != "decode" for seq in seqs):
        core.step()
    entry = trees._capture(trees.shape(seqs, 6))
    trees._load(entry, seqs, 6)
    assert entry.host_context_rows.tolist()[:3] == [9, 16, 14]
    pool = core.drafter_pool
    assert pool is not None
    before = pool.keys.clone(), pool.values.clone()

    module_logits = trees._draft(entry.drafter_batch, entry.context_rows)  # [requests, block - 1, vocab]
    module_kv = pool.keys.clone(), pool.values.clone()
    pool.keys.copy_(before[0])
    pool.values.copy_(before[1])
    trees.fused_drafter = (target, fuse_drafter_weights(drafter))
    fused_logits = trees._draft(entry.drafter_batch, entry.context_rows)

    real = entry.drafter_batch.counts > 0  # [requests]
    assert real.tolist() == [True, True, True, False]
    torch.testing.assert_close(fused_logits[real], module_logits[real], atol=1e-4, rtol=1e-4)
    assert torch.isfinite(fused_logits).all()
    kept = torch.ones(pool.keys.shape[2], dtype=torch.bool)
    kept[pool.trash_slot] = False
    for fused_rows, module_rows, old_rows in zip((pool.keys, pool.values), module_kv, before, strict=True):
        # slots neither pass wrote keep the pool's uninitialised memory, the same in both (NaN bits included)
        torch.testing.assert_close(fused_rows[:, :, kept], module_rows[:, :, kept], atol=1e-5, rtol=1e-5,
                                   equal_nan=True)
        written = (module_rows != old_rows) & ~(module_rows.isnan() & old_rows.isnan())
        assert written[:, :, kept].any()  # the pass did write the pool
