"""The fixed-shape (padded) passes that CUDA graphs capture compute what the packed passes compute: run eagerly on
the CPU, the target's decoding rows and the drafter's blocks of several requests match the packed ones, and the core
run through them eagerly gives each request its tokens alone."""

from __future__ import annotations

import pytest
import torch

from dflash.batch.core import BatchCore
from dflash.batch.draft_pass import DraftRows, run_drafter
from dflash.batch.graphs import padded_drafter_forward
from dflash.batch.padded import PaddedBatch, PaddedShape, padded_forward
from dflash.batch.pool import SlotTable
from dflash.batch.target_pass import TargetRows, run_target
from dflash.speculative.tree import build_tree, tree_verify_inputs
from tests.batch_helpers import (
    decoding_core,
    drain,
    make_core,
    make_sequence,
    mixed_target_rows,
    plain_core_with_tree_plain_chain,
)
from tests.spec_helpers import golden_pair, one_torch_thread, random_prompts, run
from tests.tiny_models import hf_tiny, ours_from_hf

_one_thread = one_torch_thread  # autouse, module scope


def test_the_padded_target_pass_equals_the_packed_one() -> None:
    """A plain step, a 4-row chain and a 7-node tree in one padded batch of 4 request slots and 8 rows each."""
    target, _, core, seqs = decoding_core()
    items = mixed_target_rows(target, seqs)
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
    target, drafter, core, seqs = decoding_core()
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


def test_the_eager_padded_core_gives_each_request_its_tokens_alone() -> None:
    """The CUDA path's core (padded rows, buffers loaded from the host, outputs read back per request) run eagerly
    on the CPU: a mixed batch of plain, linear and DDTree requests of different lengths, some joining while others
    decode, gives each request its tokens alone (float32)."""
    target, drafter = golden_pair()
    prompts = random_prompts(7, target.config.vocab_size, seed=21, lengths=(7, 90, 40, 3))
    references = [run(target, None, p, 24)[0] for p in prompts]
    core = make_core(target, drafter, max_batch=5, prefill_chunk=32, eager_padded=True)
    assert core.graphs is not None and core.drafter_graphs is not None
    seqs = [make_sequence(target, p, 24, ("none", "linear", "ddtree")[i % 3]) for i, p in enumerate(prompts)]
    for seq in seqs:
        core.add(seq)
    drain(core)
    assert core.graphs.captured > 1  # several shapes were met
    for seq, reference in zip(seqs, references, strict=True):
        assert seq.error is None
        assert seq.sink.token_ids == reference, seq.mode
    assert core.target_pool.free_blocks == core.target_pool.num_blocks


def _a_tree_and_a_chain(seed: int) -> tuple[BatchCore, list[TargetRows]]:
    """A decoding core (`decoding_core`) and two requests' rows: the first a tree of 6 nodes, the second a chain of
    3 rows."""
    target, _, core, seqs = decoding_core()
    tree = build_tree(torch.randn(5, target.config.vocab_size, generator=torch.Generator().manual_seed(seed)), 6)
    tokens, positions, visibility = tree_verify_inputs(tree, seqs[0].pending, seqs[0].start, 0)
    return core, [
        TargetRows(seqs[0].target, tokens, positions, visibility),
        TargetRows(seqs[1].target, torch.tensor([seqs[1].pending, 5, 6]), torch.arange(seqs[1].start, seqs[1].start + 3)),
    ]


def test_derived_slots_and_masks_follow_each_request_s_table() -> None:
    """The slots and masks the device derives from the loaded buffers: each request reads its committed slots and
    then its new rows' slots, writes its real rows only, and sees its committed keys plus its rows' own visibility
    (a chain causal, a tree by ancestors); padding rows and requests write the trash slot and see key 0."""
    core, items = _a_tree_and_a_chain(seed=1)
    pool = core.target_pool
    shape = PaddedShape.of(items, 4)
    batch = PaddedBatch(shape, pool, None)
    batch.load(items)
    batch.derive()
    rows, keys = shape.rows, shape.keys
    for index, item in enumerate(items):
        n, past = int(item.tokens.numel()), item.table.length
        slots = item.table.slots(0, past + n)
        assert torch.equal(batch.read_slots[index, : past + n], slots)
        assert (batch.read_slots[index, past + n :] == pool.trash_slot).all()
        written = batch.write_slots.view(-1, rows)[index]
        assert torch.equal(written[:n], slots[past:])
        assert (written[n:] == pool.trash_slot).all()
        assert (batch.store_slots.view(-1, rows)[index, n:] == -1).all()
        expected = torch.zeros(rows, keys, dtype=torch.bool)
        expected[:, 0] = True
        expected[:n, :past] = True
        among = item.visibility if item.visibility is not None else torch.ones(n, n, dtype=torch.bool).tril()
        expected[:n, past : past + n] = among
        # a padding row of a real request may see more than key 0 (its output is never read): compare real rows
        assert torch.equal(batch.full_mask[index, 0, :n], expected[:n])
    assert (batch.read_slots[len(items) :] == pool.trash_slot).all()  # padding requests
    assert (batch.write_slots.view(-1, rows)[len(items) :] == pool.trash_slot).all()
    padding = batch.full_mask[len(items) :, 0]
    assert padding[..., 0].all() and not padding[..., 1:].any()


def test_one_request_s_row_loads_as_a_whole_load_writes_it_and_leaves_the_others() -> None:
    """`load_row` (a request joining a chain of device rounds) writes what `load` writes for that request (tokens,
    positions, committed length, row count, block table, visibility) and nothing of the other requests'."""
    core, items = _a_tree_and_a_chain(seed=2)
    shape = PaddedShape.of(items, 4)
    whole = PaddedBatch(shape, core.target_pool, None)
    whole.load(items)
    rowwise = PaddedBatch(shape, core.target_pool, None)
    rowwise.load([items[1], items[1]])  # slot 0 holds another request's inputs first
    rowwise.load_row(0, items[0])
    buffers = ("tokens", "positions", "past", "counts", "blocks", "visibility")
    for name in buffers:
        assert torch.equal(getattr(rowwise, name)[0], getattr(whole, name)[0]), name
        assert torch.equal(getattr(rowwise, name)[1], getattr(whole, name)[1]), name  # slot 1 untouched
    rowwise.load_row(1, items[0])
    assert torch.equal(rowwise.blocks[1], whole.blocks[0]) and torch.equal(rowwise.visibility[1], whole.visibility[0])


def test_the_eager_padded_core_keeps_sliding_windows() -> None:
    """A model with sliding-window layers (window 16) through the padded passes: its windowed masks are derived on
    the device from the rows' positions, and prompts past the window give each request its tokens alone."""
    target = ours_from_hf(hf_tiny("gemma3"))
    assert target.sliding_window is not None
    prompts = random_prompts(4, target.config.vocab_size, seed=23, lengths=(5, 40, 23))
    references = [run(target, None, p, 20)[0] for p in prompts]
    core = make_core(target, None, max_batch=3, prefill_chunk=16, eager_padded=True)
    seqs = [make_sequence(target, p, 20, "none") for p in prompts]
    for seq in seqs:
        core.add(seq)
    drain(core)
    for seq, reference in zip(seqs, references, strict=True):
        assert seq.error is None and seq.sink.token_ids == reference


def _fused_kernels_runnable() -> bool:
    from dflash.kernels.triton_decode import interpreting, triton_available

    return triton_available() and (torch.cuda.is_available() or interpreting())


@pytest.mark.gpu
@pytest.mark.skipif(not _fused_kernels_runnable(), reason="needs Triton (a GPU, or TRITON_INTERPRET=1)")
def test_the_fused_padded_pass_equals_the_module_pass() -> None:
    """The fused kernels' padded pass (what the CUDA graphs replay) reads the same derived slots and masks: a
    plain row, a chain and a tree in one batch give the module-by-module padded pass's logits and features, and
    store the same K/V (padding rows store nothing). On the CPU through Triton's interpreter."""
    from dflash.batch.fused_padded import fused_padded_forward, supports_fused_layers

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    _, _, _, seqs = decoding_core()
    target = golden_pair(str(device))[0]
    assert supports_fused_layers(target)
    core, items = plain_core_with_tree_plain_chain(target, [seq.request.prompt_ids for seq in seqs], tree_seed=2)
    pool = core.target_pool
    with torch.inference_mode():
        batch = PaddedBatch(PaddedShape.of(items, 4), pool, None)
        batch.load(items)
        logits, features = padded_forward(target, pool, batch, core.capture)
        written = pool.keys.clone()
        fused_logits, fused_features = fused_padded_forward(target, pool, batch, core.capture)
    for index, item in enumerate(items):
        n = int(item.tokens.numel())
        torch.testing.assert_close(fused_logits[index, :n], logits[index, :n], atol=1e-4, rtol=1e-4)
        if features is not None and fused_features is not None:
            torch.testing.assert_close(fused_features[index, :n], features[index, :n], atol=1e-4, rtol=1e-4)
        slots = item.table.slots(item.table.length, item.table.length + n)
        torch.testing.assert_close(pool.keys[:, :, slots], written[:, :, slots], atol=1e-4, rtol=1e-4)


def test_graphs_captured_ahead_cover_every_shape_the_steps_meet() -> None:
    """`capture_graphs` (the GPU's warm-up) sets up every request bucket with every row bucket its steps can have:
    a mixed load of plain, linear and DDTree requests, with a row cap that shrinks the rounds as requests join and
    a batch limit that is not a power of two, meets no shape later (on a GPU each would be a capture mid-traffic,
    holding up every request of that step)."""
    target, drafter = golden_pair()
    core = make_core(target, drafter, max_batch=6, prefill_chunk=32, ddtree_budget=8, linear_drafts=7,
                     max_step_rows=24, eager_padded=True)
    assert core.graphs is not None and core.drafter_graphs is not None
    captured = core.capture_graphs(max_keys=256)
    target_shapes, drafter_shapes = core.graphs.captured, core.drafter_graphs.graphs.captured
    assert captured == target_shapes + drafter_shapes
    prompts = random_prompts(9, target.config.vocab_size, seed=5, lengths=(5, 30, 12))
    seqs = [make_sequence(target, p, 40, ("ddtree", "linear", "none")[i % 3]) for i, p in enumerate(prompts)]
    for seq in seqs[:2]:  # a few first, the rest joining while they decode
        core.add(seq)
    for _ in range(6):
        core.step()
    for seq in seqs[2:]:
        core.add(seq)
    drain(core)
    assert all(seq.error is None for seq in seqs)
    assert (core.graphs.captured, core.drafter_graphs.graphs.captured) == (target_shapes, drafter_shapes)


def test_prompt_chunks_through_the_padded_pass_equal_the_packed_pass() -> None:
    """Prompt chunks of three requests in one eager padded pass (a second chunk after 32 committed positions, a
    chunk that is not its prompt's last, a whole short prompt): the packed pass's last-row logits and every row's
    features."""
    target, drafter = golden_pair()
    core = make_core(target, drafter, max_batch=4, prefill_chunk=32, eager_padded=True)  # the drafter's features
    assert core.graphs is not None
    pool = core.target_pool
    prompts = random_prompts(3, target.config.vocab_size, seed=41, lengths=(50, 20, 7))
    tables = []
    for prompt in prompts:
        table = SlotTable(pool)
        table.reserve(len(prompt) + 8)
        tables.append(table)
    with torch.inference_mode():
        run_target(target, pool, [TargetRows(tables[0], torch.tensor(prompts[0][:32]), torch.arange(32))], core.capture)
        tables[0].crop(32)
        items = [
            TargetRows(tables[0], torch.tensor(prompts[0][32:]), torch.arange(32, 50), logit_rows=slice(17, 18)),
            TargetRows(tables[1], torch.tensor(prompts[1][:16]), torch.arange(16), logit_rows=slice(0, 0)),
            TargetRows(tables[2], torch.tensor(prompts[2]), torch.arange(7), logit_rows=slice(6, 7)),
        ]
        packed = run_target(target, pool, items, core.capture)
        assert core.graphs.prefill_fits(items)
        padded = core.graphs.prefill(items)
    assert packed.features is not None and padded.features is not None
    for index in range(len(items)):
        torch.testing.assert_close(padded.logits[index], packed.logits[index], atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(padded.features[index], packed.features[index], atol=2e-5, rtol=1e-5)
    assert padded.logits[1].shape[0] == 0 and padded.logits[0].shape[0] == 1


def test_the_eager_padded_core_prefills_long_chunks_packed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks reaching past the padded prefill's key limit go through the packed pass, the others through the
    padded one, in the same core: every request's tokens alone."""
    from dflash.batch import graphs as graphs_module

    monkeypatch.setattr(graphs_module, "MAX_PREFILL_KEYS", 48)
    target, drafter = golden_pair()
    prompts = random_prompts(5, target.config.vocab_size, seed=43, lengths=(7, 90, 40))
    references = [run(target, None, p, 16)[0] for p in prompts]
    core = make_core(target, drafter, max_batch=5, prefill_chunk=32, eager_padded=True)
    assert core.graphs is not None
    padded_passes: list[int] = []
    prefill = core.graphs.prefill

    def counted(items):  # type: ignore[no-untyped-def]
        padded_passes.append(len(items))
        return prefill(items)

    core.graphs.prefill = counted
    seqs = [make_sequence(target, p, 16, ("none", "ddtree")[i % 2]) for i, p in enumerate(prompts)]
    for seq in seqs:
        core.add(seq)
    steps = drain(core)
    assert padded_passes and len(padded_passes) < steps
    for seq, reference in zip(seqs, references, strict=True):
        assert seq.error is None and seq.sink.token_ids == reference, seq.mode
