"""Batched DDTree rounds with every tree on the device: one graph replay and one read per round, each round launched
before the previous one is read.

The host-built batched round (`dflash.batch.core`) reads each request's draft candidates back, grows its tree on the
host, ships the tree to the verification and reads every row's choice back: at 8 requests that host work and its
synchronisations cost more than the GPU's passes. Where every decoding request is a DDTree request (greedy, or sampled:
its rows drawn on the device, `dflash.batch.device_sampling`), a step is instead one graph (captured per `TreeShape`, or run eagerly off CUDA) that:

1. writes each request's new drafter context (the features of the positions it committed last round, kept on the
   device in `context`) into the drafter pool as keys and values;
2. runs every request's drafter block (`dflash.batch.graphs.padded_drafter_forward`; with the fused kernels
   `dflash.batch.fused_padded.fused_padded_drafter_forward` does steps 1 and 2 in one pass);
3. grows every request's tree from its block's logits, all trees at once (`dflash.fastpath.batched_trees`), straight
   into the verification's inputs;
4. verifies every tree in one padded target pass and walks each tree with the target's choice at every row (the
   argmax, or a sampled request's draw);
5. moves each accepted path's K/V rows to the slots right after its committed prefix and keeps their features as the
   request's next context;
6. leaves the next round's inputs on the device (pending token, committed lengths, positions, context rows);

and writes [accepted, committed tokens...] per request to one buffer, read back once. While the same requests go on
with the same shape, the next round is launched from step 6's state before this one is read (`launch(follow=True)`),
so the host's commits overlap the GPU; otherwise every round is read before the next is loaded from the host. The
host commits the tokens as it commits a host-built round's. Greedy verification accepts exactly the target's own argmax path, so the output is
the target's greedy decoding whatever the tree (the device and host trees may differ on exact score ties); a sampled
request's walk follows its sampled tokens, so each committed token is a sample of the target's distribution.

Linear DFlash requests take the same rounds with `chain=True`: each tree is one path, the drafter's argmax at
every block position (`dflash.fastpath.batched_trees.BatchedChainBuilder`), the chain a host-built linear round
verifies (a sampled request's rows sampled and walked as a tree's).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import torch

from dflash.batch.context_store import ContextStores
from dflash.batch.device_sampling import RowSampling, choice_mode, choose_rows, row_uniforms
from dflash.batch.draft_pass import DraftRows, absorb_context_rows, store_context
from dflash.batch.graphs import PaddedForward
from dflash.batch.padded import MIN_KEY_BUCKET, ROW_BUCKETS, PaddedBatch, PaddedShape, bucket_up
from dflash.batch.pool import BlockPool
from dflash.batch.sequence import Sequence
from dflash.batch.target_pass import TargetRows
from dflash.drafter.model import DFlashDrafter
from dflash.fastpath.batched_trees import BatchedChainBuilder, BatchedTreeBuilder, write_tree_inputs
from dflash.fastpath.capture import capture_graph
from dflash.fastpath.fused_drafter import FusedDrafterWeights
from dflash.host_copies import to_device
from dflash.kernels.triton_argmax import fast_argmax
from dflash.models.model import CausalLM


@dataclass(frozen=True)
class TreeShape:
    requests: int  # request bucket (`PaddedShape.bucket_requests`)
    keys: int  # key positions both passes may reach (a power of two, at least `MIN_KEY_BUCKET`)
    budget: int  # drafted nodes per tree
    chain: bool = False  # linear DFlash: each tree one path of the drafter's argmax tokens
    choice: str = "greedy"  # how the target's token at each row is chosen (`device_sampling.choice_mode`)


@dataclass
class _Entry:
    """One shape's buffers, loaded before each replay, and its graph."""

    graph: torch.cuda.CUDAGraph | None  # None: the round runs eagerly at each replay
    drafter_batch: PaddedBatch  # each request's block [pending, MASK...] at start .. start+block-1
    target_batch: PaddedBatch  # each request's tree rows (tokens, positions, visibility written on the device)
    context_rows: torch.Tensor  # [requests] long: rows of `DeviceTrees.context` that are new drafter context
    host_context_rows: torch.Tensor  # [requests] long, pinned on CUDA
    out: torch.Tensor  # [requests, depth + 2 + smaller budgets] long: accepted nodes, the committed tokens, then
    # the walk's length under each of `DeviceTrees.within` below the round's budget
    host_out: list[torch.Tensor]  # two copies of it, pinned on CUDA, used in turn (a round launched before the
    # previous one is read must not overwrite what that one's copy may still be writing)
    sampling: RowSampling  # each request's sampling parameters (sampled shapes), and their host buffers
    host_sampling: RowSampling
    turn: int = 0


@dataclass
class LaunchedRound:
    """A round launched and not read yet."""

    seqs: list[Sequence]
    shape: TreeShape
    host_out: torch.Tensor  # [requests, depth + 2 + smaller budgets], written once `event` has passed
    event: torch.cuda.Event | None


@dataclass(frozen=True)
class RoundResult:
    accepted: int  # drafted nodes accepted (the round commits accepted + 1 tokens)
    tokens: list[int]  # the committed tokens: the accepted nodes' then the bonus token
    features: torch.Tensor  # [accepted + 1, F]: their rows' features (a view of `DeviceTrees.context`)
    within: dict[int, int]  # budget below the round's -> the tokens its best nodes alone would have committed


class DeviceTrees:
    """DDTree rounds (and chains) of up to `max_requests` requests, built on the target's and drafter's padded
    passes."""

    def __init__(
        self, drafter: DFlashDrafter, target_forward: PaddedForward, drafter_forward: PaddedForward,
        target_pool: BlockPool, drafter_pool: BlockPool, feature_width: int, max_requests: int, vocab: int,
        *, memory: Any = None, graphed: bool = True, sliding_window: int | None = None,
        fused_drafter: tuple[CausalLM, FusedDrafterWeights] | None = None, within: tuple[int, ...] = (),
        context_stores: ContextStores | None = None,
    ) -> None:
        """`fused_drafter`: (the target, the drafter's joined weights) to run each round's context store and drafter
        block as one pass through the fused kernels (`fused_padded_drafter_forward`) instead of `drafter_forward`.
        `within`: budgets whose walk lengths each round also reports, for those below its own (`RoundResult`).
        `context_stores`: the graphs that write context rows beyond a round's own (else they are written eagerly)."""
        self.within = tuple(sorted(within))
        self.drafter, self.target_forward, self.drafter_forward = drafter, target_forward, drafter_forward
        self.fused_drafter = fused_drafter
        self.context_stores = context_stores
        # (drafter batch, context rows [requests]) -> draft logits [requests, block - 1, vocab]: `_draft`
        self.draft_pass: Callable[[PaddedBatch, torch.Tensor], torch.Tensor] = self._draft
        self.target_pool, self.drafter_pool, self.vocab = target_pool, drafter_pool, vocab
        self.max_requests, self.graphed, self.window = max_requests, graphed, sliding_window
        self.block = drafter.config.block_size
        self._memory = memory
        device, dtype = target_pool.device, drafter.fc.weight.dtype
        # each request's new drafter context rows (by its index in the step): at most a block, the rows a round keeps;
        # zeros at first: rows beyond a request's count are written to the trash slot, which must stay finite
        self.context = torch.zeros(max_requests, self.block, feature_width, dtype=dtype, device=device)
        self._handed: list[torch.Tensor | None] = [None] * max_requests  # the context views given out, by index
        self._entries: dict[TreeShape, _Entry] = {}
        self.launched: LaunchedRound | None = None
        self._builders: dict[tuple[int, bool], BatchedTreeBuilder] = {}  # (budget, chain) ->
        self._smaller: dict[int, torch.Tensor] = {}  # budget -> [smaller budgets of `within`] long
        from dflash.kernels.triton_kv_move import pool_move_usable

        self._move_programs = pool_move_usable(target_pool.keys, target_pool.values)  # `_keep_paths` in one launch
        self._mask_block = torch.full((self.block,), drafter.config.mask_token_id, dtype=torch.long)
        self._visible = torch.ones(self.block, self.block, dtype=torch.bool)  # the block sees itself both ways

    @property
    def captured(self) -> int:
        return sum(1 for entry in self._entries.values() if entry.graph is not None)

    def depth(self, budget: int) -> int:
        """Drafted positions a tree of `budget` nodes grows over."""
        return min(self.block - 1, budget)

    def shape(self, seqs: list[Sequence], budget: int, chain: bool = False) -> TreeShape:
        """The shape of a round of `seqs`, or of the round after it (the keys reach one round further: a round
        launched before the previous one is read starts up to `depth + 1` positions past the host's `start`)."""
        reach = max(seq.start for seq in seqs) + self.depth(budget) + 1 + max(self.block, budget + 1)
        keys = max(MIN_KEY_BUCKET, 1 << (reach - 1).bit_length())
        choice = choice_mode([seq.chooser.params for seq in seqs])
        return TreeShape(PaddedShape.bucket_requests(len(seqs), self.max_requests), keys, budget, chain, choice)

    def ensure(self, shape: TreeShape) -> None:
        if shape not in self._entries:
            self._capture(shape)

    # ---- a step ------------------------------------------------------------------------------------------
    def can_follow(self, seqs: list[Sequence], budget: int, chain: bool = False, joined: Collection[int] = ()) -> bool:
        """Whether a round of `seqs` can be launched straight after the unread one, from the state that round
        leaves on the device: the same requests in the same order (but at `joined`: requests joining in slots
        where one ended or none was, their inputs loaded from the host), the same budget and shape."""
        launched = self.launched
        if launched is None or len(seqs) < len(launched.seqs):
            return False
        for index, seq in enumerate(seqs):
            before = launched.seqs[index] if index < len(launched.seqs) else None
            if index in joined:
                if before is not None and before.phase != "done":
                    return False
            elif seq is not before:
                return False
        return launched.shape == self.shape(seqs, budget, chain)

    def launch(
        self, seqs: list[Sequence], budget: int, *, chain: bool = False, follow: bool = False,
        ended: list[int] | None = None, joined: Collection[int] = (),
    ) -> LaunchedRound | None:
        """Launch one round for each of `seqs` (DDTree or linear requests, at most `max_requests`, each able to draft
        `depth(budget)` positions), nothing read back; returns the round launched before it, unread (None if none).
        `follow` (`can_follow`): its inputs are what the previous round left on the device (the host state lags one
        round), but for `ended` (indexes of requests that ended since: their slots become padding) and `joined`
        (indexes of requests joining: their inputs loaded from the host, which has committed all of theirs);
        otherwise they are loaded from the host, which must have read every earlier round."""
        previous = self.launched
        shape = previous.shape if follow and previous is not None else self.shape(seqs, budget, chain)
        entry = self._entries.get(shape) or self._capture(shape)
        if not follow:
            assert previous is None, "a round loaded from the host needs every earlier round read"
            self._load(entry, seqs, budget)
        elif ended:  # requests that ended: padding from now on (no rows, nothing read or written in their blocks)
            index = to_device(torch.tensor(ended, dtype=torch.long), entry.out.device)  # queued: no wait
            for batch in (entry.drafter_batch, entry.target_batch):
                batch.counts.index_fill_(0, index, 0)
                batch.past.index_fill_(0, index, 0)
            entry.context_rows.index_fill_(0, index, 0)
        if follow:
            for slot in joined:
                self._join(entry, slot, seqs[slot], budget)
        if entry.graph is not None:
            entry.graph.replay()
        else:
            self._round(entry, shape)
        host = entry.host_out[entry.turn]
        entry.turn ^= 1
        host.copy_(entry.out, non_blocking=True)
        event = None
        if entry.out.is_cuda:
            event = torch.cuda.Event()
            event.record()
        self.launched = LaunchedRound(seqs, shape, host, event)
        return previous

    def take(self) -> LaunchedRound | None:
        """The unread round, no longer followed (None if none)."""
        launched, self.launched = self.launched, None
        return launched

    def read(self, launched: LaunchedRound) -> list[RoundResult]:
        """A launched round's results, once it has run. Each request's features are a view of `context`, valid until
        the next round is launched."""
        if launched.event is not None:
            launched.event.synchronize()
        rows: list[list[int]] = launched.host_out[: len(launched.seqs)].tolist()  # [requests, columns]
        budget = launched.shape.budget
        depth = self.depth(budget)
        smaller = [b for b in self.within if b < budget]
        results = []
        for index, row in enumerate(rows):
            accepted = row[0]
            features = self.context[index, : accepted + 1]
            self._handed[index] = features
            within = dict(zip(smaller, row[depth + 2 :], strict=True))
            results.append(RoundResult(accepted, row[1 : accepted + 2], features, within))
        return results

    def _load(self, entry: _Entry, seqs: list[Sequence], budget: int) -> None:
        """Each request's new context into `context` (where it is not there already), its drafter table advanced
        over it, and both batches' host-side inputs."""
        moved: list[tuple[int, Sequence, torch.Tensor]] = []
        for index, seq in enumerate(seqs):
            features = seq.new_features
            assert features is not None and seq.drafter is not None and seq.target is not None
            if features is not self._handed[index]:
                moved.append((index, seq, features))
        # a request's context may be another index's view: read every source before any is overwritten
        sources = [f.clone() if _shares(f, self.context) else f for _, _, f in moved]
        # features beyond the last block's (the rows of plain steps taken since the last tree) go in first, every
        # request's in one write: a write per request would launch its passes once per request
        excess = [
            DraftRows(seq.drafter, features[: features.shape[0] - self.block], 0, 0, 0)
            for (_, seq, _), features in zip(moved, sources, strict=True)
            if seq.drafter is not None and features.shape[0] > self.block
        ]
        if self.context_stores is not None:
            self.context_stores.absorb(excess)
        else:
            absorb_context_rows(self.drafter, self.drafter_pool, excess)
        for (index, _, _), features in zip(moved, sources, strict=True):
            kept = features[-self.block :]
            self.context[index, : kept.shape[0]].copy_(kept)
            self._handed[index] = None
        counts = entry.host_context_rows.numpy()
        counts.fill(0)
        drafter_rows, target_rows = [], []
        dummy = torch.zeros(budget + 1, dtype=torch.long)
        for index, seq in enumerate(seqs):
            assert seq.drafter is not None and seq.target is not None and seq.new_features is not None
            rows = min(seq.new_features.shape[0], self.block)
            counts[index] = rows
            assert seq.drafter.length + rows == seq.start, "the drafter context must end right before the block"
            seq.drafter.crop(seq.start)  # its context rows are written in the round, before the block reads them
            tokens = self._mask_block.clone()
            tokens[0] = seq.pending
            positions = torch.arange(seq.start, seq.start + self.block)
            drafter_rows.append(TargetRows(seq.drafter, tokens, positions, self._visible))
            target_rows.append(TargetRows(seq.target, dummy, dummy))  # tokens and positions come from the tree
        entry.drafter_batch.load(drafter_rows)
        entry.target_batch.load(target_rows)
        entry.context_rows.copy_(entry.host_context_rows, non_blocking=True)
        if entry.sampling is not entry.host_sampling:  # sampled shapes: each request's parameters and seed
            entry.host_sampling.fill([s.chooser.params for s in seqs], [s.row_seed() for s in seqs])
            entry.sampling.copy_(entry.host_sampling)

    def _join(self, entry: _Entry, index: int, seq: Sequence, budget: int) -> None:
        """Request `seq` into slot `index` of a followed round, the other slots untouched: its new drafter context
        (at most a block: the rest was written as its prompt ended) into `context`, its block and tree rows' inputs,
        its context row count and sampling row, all from the host's committed state."""
        features = seq.new_features
        assert features is not None and seq.drafter is not None and seq.target is not None
        rows = features.shape[0]
        assert rows <= self.block, "a joining request's context beyond a block is written before it joins"
        self.context[index, :rows].copy_(features.clone() if _shares(features, self.context) else features)
        self._handed[index] = None
        assert seq.drafter.length + rows == seq.start, "the drafter context must end right before the block"
        seq.drafter.crop(seq.start)
        tokens = self._mask_block.clone()
        tokens[0] = seq.pending
        positions = torch.arange(seq.start, seq.start + self.block)
        entry.drafter_batch.load_row(index, TargetRows(seq.drafter, tokens, positions, self._visible))
        dummy = torch.zeros(budget + 1, dtype=torch.long)
        entry.target_batch.load_row(index, TargetRows(seq.target, dummy, dummy))
        device = entry.context_rows.device
        entry.context_rows[index : index + 1].copy_(to_device(torch.tensor([rows], dtype=torch.long), device))
        if entry.sampling is not entry.host_sampling:  # sampled shapes: its parameters and seed
            row = RowSampling.zeros(1, torch.device("cpu"))
            row.fill([seq.chooser.params], [seq.row_seed()])
            for mine, theirs in zip(entry.sampling.fields(), row.fields(), strict=True):
                mine[index : index + 1].copy_(to_device(theirs, device))

    # ---- the round (captured) ----------------------------------------------------------------------------
    def _round(self, entry: _Entry, shape: TreeShape) -> None:
        drafter_batch, target_batch = entry.drafter_batch, entry.target_batch
        budget = shape.budget
        depth = self.depth(budget)
        draft_logits = self.draft_pass(drafter_batch, entry.context_rows)  # [requests, block - 1, vocab]
        builder = self._builder(budget, shape.chain)
        trees = builder.grow(draft_logits)
        write_tree_inputs(trees, drafter_batch.tokens[:, 0], target_batch.past, target_batch.tokens,
                          target_batch.positions, target_batch.visibility)
        logits, features = self.target_forward(target_batch)  # [requests, rows, vocab], [requests, rows, F]
        assert features is not None
        requests, rows = logits.shape[:2]
        choices = fast_argmax(logits.view(requests * rows, -1)).view(requests, rows)  # [requests, rows]
        # a sampled request's rows: a draw from its filtered distribution (the walk then follows the sampled token)
        if shape.choice != "greedy":
            uniforms = row_uniforms(entry.sampling.seed, target_batch.positions[:, :rows])  # [requests, rows]
            choices = choose_rows(logits, entry.sampling, uniforms, shape.choice, choices)
        # out: [accepted, committed tokens (depth + 1), walk lengths within the smaller budgets]
        paths, lengths = builder.walk_into(trees, choices, self._smaller[budget], entry.out)
        self._keep_paths(target_batch, paths, lengths, features, depth)
        self._advance(entry, lengths, entry.out[:, 1 : depth + 2])

    def _advance(self, entry: _Entry, lengths: torch.Tensor, committed: torch.Tensor) -> None:
        """Leave the next round's inputs on the device (`launch(follow=True)`): each request's pending token is its
        bonus token, its committed positions and drafter context grow by the round's kept rows."""
        drafter_batch, target_batch = entry.drafter_batch, entry.target_batch
        kept = torch.where(target_batch.counts > 0, lengths, 0)  # [requests]: nothing for padding requests
        bonus = committed.gather(1, (lengths - 1).clamp(min=0)[:, None])  # [requests, 1]
        pending = drafter_batch.tokens[:, :1]
        pending.copy_(torch.where(kept[:, None] > 0, bonus, pending))
        drafter_batch.past.add_(kept)
        drafter_batch.positions.add_(kept[:, None])
        target_batch.past.add_(kept)
        entry.context_rows.copy_(kept)

    def _draft(self, batch: PaddedBatch, context_rows: torch.Tensor) -> torch.Tensor:
        """Every request's new context rows (`context`, `context_rows` [requests] of them, the positions right
        before its block) written to the drafter pool as every layer's keys and values, then every request's
        block drafted -> logits [requests, block - 1, vocab]. Through the fused kernels, one pass does both."""
        requests, rows = batch.shape.requests, self.block
        pool = self.drafter_pool
        offsets = torch.arange(rows, device=pool.device)  # [rows]
        positions = batch.past[:, None] - context_rows[:, None] + offsets[None]  # [requests, rows]
        real = offsets[None] < context_rows[:, None]
        positions = torch.where(real, positions, 0)
        slots = _slots(batch, positions)  # [requests, rows]
        if self.fused_drafter is not None:
            from dflash.batch.fused_padded import fused_padded_drafter_forward

            target, weights = self.fused_drafter
            stored = torch.where(real, slots, -1).reshape(-1)  # [requests * rows]: -1 stores nothing
            return fused_padded_drafter_forward(
                self.drafter, target, pool, weights, batch, self.context[:requests], positions, stored
            )
        store_context(self.drafter, pool, self.context[:requests], positions,
                      torch.where(real, slots, pool.trash_slot).reshape(-1))
        logits, _ = self.drafter_forward(batch)
        return logits

    def _keep_paths(
        self, batch: PaddedBatch, paths: torch.Tensor, lengths: torch.Tensor, features: torch.Tensor, depth: int
    ) -> None:
        """paths [requests, depth + 1] rows from each root, lengths [requests]: the path's K/V rows move to the
        positions right after the committed prefix, its rows' features become the request's next context."""
        pool = self.target_pool
        if self._move_programs:  # one launch: every request's K/V rows and features
            from dflash.kernels.triton_kv_move import move_tree_paths

            move_tree_paths(pool.keys, pool.values, batch.blocks, pool.block_size, batch.past, batch.counts, paths,
                            lengths, features.contiguous(), self.context)
            return
        steps = torch.arange(depth + 1, device=paths.device)  # [depth + 1]
        keep = (steps[None] < lengths[:, None]) & (batch.counts[:, None] > 0)  # [requests, depth + 1]
        source = torch.where(keep, _slots(batch, batch.past[:, None] + paths), pool.trash_slot).reshape(-1)
        dest = torch.where(keep, _slots(batch, batch.past[:, None] + steps[None]), pool.trash_slot).reshape(-1)
        for storage in (pool.keys, pool.values):  # [layers, kv_heads, slots, head_dim]
            storage[:, :, dest] = storage[:, :, source]  # the gather copies before the scatter writes
        requests, width = paths.shape[0], features.shape[-1]
        kept = features.gather(1, paths[:, :, None].expand(requests, depth + 1, width))  # [requests, depth + 1, F]
        context = self.context[:requests, : depth + 1]
        context.copy_(torch.where(keep[:, :, None], kept.to(context.dtype), context))

    # ---- shapes ------------------------------------------------------------------------------------------
    def _builder(self, budget: int, chain: bool = False) -> BatchedTreeBuilder:
        builder = self._builders.get((budget, chain))
        if builder is None:
            device = self.target_pool.device
            if chain:
                builder = BatchedChainBuilder(budget, self.vocab, device, self.max_requests)
            else:
                builder = BatchedTreeBuilder(budget, self.depth(budget), self.vocab, device, self.max_requests)
            self._builders[(budget, chain)] = builder
            # the budgets below this one whose walk lengths its rounds report, made before any capture
            self._smaller[budget] = torch.tensor([b for b in self.within if b < budget], dtype=torch.long,
                                                 device=device)
        return builder

    def _capture(self, shape: TreeShape) -> _Entry:
        device = self.target_pool.device
        pinned = device.type == "cuda"
        requests, depth = shape.requests, self.depth(shape.budget)
        columns = depth + 2 + sum(1 for b in self.within if b < shape.budget)
        drafter_shape = PaddedShape(requests, bucket_up(self.block, ROW_BUCKETS), shape.keys)
        target_shape = PaddedShape(requests, bucket_up(shape.budget + 1, ROW_BUCKETS), shape.keys)
        sampling = RowSampling.zeros(requests, device)  # one set (never loaded) where every request is greedy
        host_sampling = sampling if shape.choice == "greedy" else RowSampling.zeros(requests, torch.device("cpu"),
                                                                                        pin_memory=pinned)
        entry = _Entry(
            None, PaddedBatch(drafter_shape, self.drafter_pool, None),
            PaddedBatch(target_shape, self.target_pool, self.window),
            torch.zeros(requests, dtype=torch.long, device=device),
            torch.zeros(requests, dtype=torch.long, pin_memory=pinned),
            torch.zeros((requests, columns), dtype=torch.long, device=device),
            [torch.zeros((requests, columns), dtype=torch.long, pin_memory=pinned) for _ in range(2)],
            sampling, host_sampling,
        )
        self._builder(shape.budget, shape.chain)  # made before any capture
        self._entries[shape] = entry
        if not self.graphed:
            return entry
        # the buffers hold no request: every row is padding, nothing real is written (the context stays)
        entry.graph, _ = capture_graph(lambda: self._round(entry, shape), self._memory, warmups=2)
        return entry


def _slots(batch: PaddedBatch, positions: torch.Tensor) -> torch.Tensor:
    """positions [requests, n] (each within the batch's key blocks) -> their pool slots by each request's table."""
    size = batch.pool.block_size
    blocks = batch.blocks.gather(1, (positions // size).clamp(max=batch.key_blocks - 1))  # [requests, n]
    return blocks * size + positions % size


def _shares(tensor: torch.Tensor, other: torch.Tensor) -> bool:
    return tensor.untyped_storage().data_ptr() == other.untyped_storage().data_ptr()

