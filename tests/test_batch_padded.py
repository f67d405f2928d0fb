"""The fixed-shape (padded) passes that CUDA graphs capture compute what the packed passes compute: run eagerly on
the CPU, the target's decoding rows and the drafter's blocks of several requests match the packed ones."""

from __future__ import annotations

import torch

from dflash.batch.draft_pass import DraftRows, run_drafter
from dflash.batch.graphs import padded_drafter_forward
from dflash.batch.padded import PaddedBatch, PaddedShape, padded_forward
from dflash.batch.target_pass import TargetRows, run_target
from dflash.speculative.tree import build_tree, tree_verify_inputs
from tests.batch_helpers import make_core, make_sequence
from tests.spec_helpers import golden_pair, one_torch_thread, random_prompts

_one_thread = one_torch_thread  # autouse, module scope


def _decoding_core() -> tuple:  # type: ignore[type-arg]
    target, drafter = golden_pair()
    core = make_core(target, drafter)
    prompts = random_prompts(3, target.config.vocab_size, seed=31, lengths=(9, 40, 20))
    seqs = [make_sequence(target, p, 10, "ddtree") for p in prompts]
    for seq in seqs:
        core.add(seq)
    while any(seq.phase != "decode" for seq in seqs):
        core.step()
    return target, drafter, core, seqs


def test_the_padded_target_pass_equals_the_packed_one() -> None:
    """A plain step, a 4-row chain and a 7-node tree in one padded batch of 4 request slots and 8 rows each."""
    target, _, core, seqs = _decoding_core()
    g = torch.Generator().manual_seed(0)
    items = []
    for index, seq in enumerate(seqs):
        if index == 1:
            tree = build_tree(torch.randn(5, target.config.vocab_size, generator=g), 7)
            tokens, positions, visibility = tree_verify_inputs(tree, seq.pending, seq.start, 0)
            items.append(TargetRows(seq.target, tokens, positions, visibility, logit_rows=slice(0, len(tokens))))
        else:
            n = 1 + 3 * (index // 2)
            tokens = torch.tensor([seq.pending] + [3] * (n - 1))
            items.append(TargetRows(seq.target, tokens, torch.arange(seq.start, seq.start + n), logit_rows=slice(0, n)))
    with torch.inference_mode():
        packed = run_target(target, core.target_pool, items, core.capture)
        shape = PaddedShape.of(items, 8)
        assert (shape.requests, shape.rows) == (4, 8)
        batch = PaddedBatch(shape, core.target_pool, target.sliding_window)
        batch.load(items)
        logits, features = padded_forward(target, core.target_pool, batch, core.capture)
    assert packed.features is not None and features is not None and torch.isfinite(logits).all()
    for index, item in enumerate(items):
        n = int(item.tokens.numel())
        torch.testing.assert_close(logits[index, :n], packed.logits[index], atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(features[index, :n], packed.features[index], atol=2e-5, rtol=1e-5)


def test_the_padded_drafter_block_pass_equals_the_packed_one() -> None:
    target, drafter, core, seqs = _decoding_core()
    assert core.drafter_pool is not None
    block = drafter.config.block_size
    with torch.inference_mode():
        items = []
        for seq in seqs:
            assert seq.drafter is not None and seq.new_features is not None
            items.append(DraftRows(seq.drafter, seq.new_features, seq.pending, seq.start, block - 1))
        packed = run_drafter(drafter, target, core.drafter_pool, items)  # absorbs the context rows
        rows = []
        for item in items:
            tokens = torch.full((block,), drafter.config.mask_token_id, dtype=torch.long)
            tokens[0] = item.pending
            visible = torch.ones(block, block, dtype=torch.bool)
            rows.append(TargetRows(item.table, tokens, torch.arange(item.start, item.start + block), visible))
        batch = PaddedBatch(PaddedShape.of(rows, 8), core.drafter_pool, None)
        batch.load(rows)
        logits, _ = padded_drafter_forward(drafter, target, core.drafter_pool, batch)
    for index, scores in enumerate(packed):
        torch.testing.assert_close(logits[index, : block - 1], scores.full(), atol=2e-5, rtol=1e-5)
