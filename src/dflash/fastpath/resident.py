"""Greedy decoding whose state stays on the device: one graph replay per round, one round queued ahead.

The host-driven loops (`dflash.generation.autoregressive`, `dflash.speculative.linear`) read every round's result back
before they can start the next one, so the GPU idles while the host checks acceptance, pushes tokens and prepares
the next round's inputs. For a greedy request served by the `GraphRunner` the whole round runs on the device:

* plain step: target forward over the pending token, argmax, the argmax becomes the next step's input;
* linear DFlash round: drafter round over the pending token and the new context rows, argmax drafts, target
  verification of [pending, drafts], the target's argmax at every row, the accepted prefix (drafts equal to the
  target's choices), the bonus token becomes the next pending token, the accepted rows' features the drafter's
  next context rows, and the committed length advances by accepted + 1;
* DDTree round: the same drafter round, the tree grown on the device (`dflash.fastpath.device_tree`), one target
  pass over [pending, nodes] under the ancestor mask, the walk, and the accepted path's K/V rows moved to the
  slots after the committed prefix.

Each round writes [accepted, committed tokens...] to a small device buffer that is copied to pinned host memory
behind it. The host launches round r+1 before it reads round r, so the device always has the next round queued
while the host pushes tokens through the sink (EOS, stop strings, max tokens, streaming). When the sink finishes,
the round still in flight is waited for and dropped: it only wrote cache rows past the committed prefix, which
the next request overwrites. Tokens are exactly the host loops' (argmax of the same logits), so the output is
plain greedy decoding's.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import torch
import torch.nn.functional as F

from dflash.drafter.model import DFlashDrafter
from dflash.fastpath.device_tree import TreeBuilder
from dflash.fastpath.runner import GraphRunner, padded_rows
from dflash.fastpath.static_forward import static_target_forward
from dflash.generation.output import OutputSink
from dflash.generation.request import GenerationStats
from dflash.generation.selection import TokenChooser
from dflash.kernels.triton_argmax import fast_argmax
from dflash.kernels.triton_kv_move import move_path_rows, move_usable
from dflash.kv.cache import KVCache
from dflash.speculative.session import SpecState

QUEUED_ROUNDS = 2  # rounds launched ahead of the host: one running, one waiting to be read


class ResidentDecoder:
    """Greedy rounds run as single graph replays on `runner`: plain steps (`drafts` 0), linear rounds of `drafts`
    drafts, or, with a tree `budget`, DDTree rounds over the drafter's first `drafts` positions."""

    def __init__(
        self, runner: GraphRunner, drafts: int, capture: tuple[int, ...] = (), budget: int | None = None
    ) -> None:
        if drafts and runner.drafter is None:
            raise ValueError("speculative resident rounds need the runner's drafter")
        if budget is not None and not (drafts and budget >= 1):
            raise ValueError("a resident tree round needs drafts and a budget >= 1")
        self.runner, self.drafts, self.capture, self.budget = runner, drafts, capture, budget
        self.rows = padded_rows((drafts if budget is None else budget) + 1)
        self.tree_builder = (
            None if budget is None else TreeBuilder(budget, drafts, runner.target.config.vocab_size, runner.device)
        )
        block = runner.drafter.config.block_size if drafts and runner.drafter is not None else 1
        self.reach = max(self.rows, block)  # slots past the committed prefix one round may write
        device = runner.device
        self.out = torch.zeros(drafts + 2, dtype=torch.long, device=device)  # [accepted, committed tokens...]
        pinned = device.type == "cuda"
        self.host = [torch.zeros(drafts + 2, dtype=torch.long, pin_memory=pinned) for _ in range(QUEUED_ROUNDS)]
        self.launched = 0  # rounds launched so far (dropped ones included)

    def fits(self, start: int, max_new_tokens: int) -> bool:
        """Whether every round of a generation from `start` stays inside the runner's storage, queued round
        included."""
        return start + max_new_tokens + (QUEUED_ROUNDS + 1) * self.reach <= self.runner.capacity

    # ---- state -------------------------------------------------------------------------------------------
    def load_plain(self, length: int, token: int) -> None:
        """The target cache holds `length` committed slots; `token` (at position `length`) is the next input."""
        self.runner.length.fill_(length)
        self.runner.row_inputs(1).input_ids.fill_(token)

    def load_linear(self, start: int, pending: int, new_features: torch.Tensor) -> None:
        """new_features: [1, rows <= block, n*hidden], the drafter's context rows for positions start-rows..start-1."""
        runner = self.runner
        rows = new_features.shape[1]
        runner.length.fill_(start)
        runner.block_ids[0, 0] = pending
        runner.draft_features[:, :rows].copy_(new_features)
        runner.draft_new_rows.fill_(rows)

    def take_over(
        self,
        state: SpecState,
        drafter_cache: KVCache,
        max_new_tokens: int,
        sink: OutputSink,
        chooser: TokenChooser,
        stats: GenerationStats,
        should_stop: Callable[[], bool] | None = None,
    ) -> bool:
        """Run a speculative generation's remaining rounds here, from its host loop's `state`, when they can be
        served now: EOS no longer suppressed, no token constraint still active (its masks are applied on the
        host), every round inside the storage. Returns whether it did (the
        generation is then over). Context rows beyond the block the round's graph takes (the prompt's, on the
        first round) are written into `drafter_cache` first (`DFlashDrafter.absorb_context`)."""
        produced = len(sink.token_ids)
        if chooser.min_tokens > produced or chooser.constrained or not self.fits(state.start, max_new_tokens - produced):
            return False
        block = self.runner.draft_features.shape[1]
        features = state.new_features  # [1, new, n*hidden]: positions drafter_cache.length .. start-1
        excess = features.shape[1] - block
        if excess > 0:
            assert self.runner.drafter is not None
            positions = torch.arange(drafter_cache.length, drafter_cache.length + excess, device=features.device)
            self.runner.drafter.absorb_context(features[:, :excess], positions[None], drafter_cache)
            features = features[:, excess:]
        self.load_linear(state.start, state.pending, features)
        self.decode(state.start, sink, stats, should_stop)
        return True

    # ---- rounds ------------------------------------------------------------------------------------------
    def _plain_step(self, bucket: int) -> list[torch.Tensor]:
        runner = self.runner
        inputs = runner.row_inputs(1)
        logits, _ = static_target_forward(
            runner.target, runner.target_storage, inputs.input_ids, runner.length.view(1, 1), runner.length,
            inputs.causal, bucket=bucket, capture=(), fused=runner.fused,
        )  # [1, 1, vocab]
        token = fast_argmax(logits[0, :1])  # [1]
        inputs.input_ids.view(1).copy_(token)
        self.out[1:2].copy_(token)
        runner.length.add_(1)
        return [self.out]

    def _linear_round(self, bucket: int) -> list[torch.Tensor]:
        runner, drafts = self.runner, self.drafts
        device = runner.device
        runner.draft_start.copy_(runner.length)
        proposed = fast_argmax(runner.drafter_block_logits(bucket, drafts))  # [drafts]
        inputs = runner.row_inputs(self.rows)
        ids = inputs.input_ids[0]
        ids[:1].copy_(runner.block_ids[0, :1])
        ids[1 : drafts + 1].copy_(proposed)
        positions = (runner.length + torch.arange(self.rows, device=device))[None]  # [1, rows]
        logits, features = static_target_forward(
            runner.target, runner.target_storage, inputs.input_ids, positions, runner.length, inputs.causal,
            bucket=bucket, capture=self.capture, fused=runner.fused,
        )  # [1, rows, vocab], [1, rows, n*hidden]
        assert features is not None
        choices = fast_argmax(logits[0, : drafts + 1])  # [drafts + 1]
        accepted = (proposed == choices[:drafts]).to(torch.long).cumprod(0).sum().view(1)  # [1]
        bonus = choices.gather(0, accepted)  # [1]
        slots = torch.arange(drafts + 1, device=device)
        committed = torch.where(slots < accepted, F.pad(proposed, (0, 1)), bonus)  # [drafts + 1]
        self.out[:1].copy_(accepted)
        self.out[1:].copy_(committed)
        runner.block_ids[0, :1].copy_(bonus)
        runner.draft_features[:, : drafts + 1].copy_(features[:, : drafts + 1])
        runner.draft_new_rows.copy_(accepted + 1)
        runner.length.add_(accepted + 1)
        return [self.out]

    def _state(self) -> list[torch.Tensor]:
        """The device tensors a round reads and advances."""
        runner = self.runner
        if not self.drafts:
            return [runner.length, runner.row_inputs(1).input_ids]
        return [runner.length, runner.block_ids, runner.draft_features, runner.draft_new_rows]

    def _tree_round(self, bucket: int) -> list[torch.Tensor]:
        runner, depth, budget, builder = self.runner, self.drafts, self.budget, self.tree_builder
        assert budget is not None and builder is not None
        runner.draft_start.copy_(runner.length)
        tree = builder.grow(runner.drafter_block_logits(bucket, depth))  # rows [budget + 1], by depth
        inputs = runner.row_inputs(self.rows)
        builder.write_inputs(
            tree, runner.block_ids[0, :1], runner.length, inputs.input_ids[0], inputs.positions[0], inputs.tree_mask
        )
        logits, features = static_target_forward(
            runner.target, runner.target_storage, inputs.input_ids, inputs.positions, runner.length,
            inputs.tree_mask, bucket=bucket, capture=self.capture, fused=runner.fused,
        )  # [1, rows, vocab], [1, rows, n*hidden]
        assert features is not None
        choices = fast_argmax(logits[0, : budget + 1])  # [budget + 1]
        # the walk also writes the round's outputs, the next pending token and the drafter's new context rows
        path, length, _, _ = builder.walk(tree, choices, (self.out, runner.block_ids[0, :1], runner.draft_new_rows))
        # the accepted rows' K/V move to the slots right after the committed prefix (the path's positions), their
        # features become the drafter's next context rows
        storage = runner.target_storage
        if builder.kernel and move_usable(storage.keys, storage.values):
            move_path_rows(
                storage.keys, storage.values, storage.positions[0], runner.length, path,
                features=(features[0], runner.draft_features[0]),
            )
        else:
            source = runner.length + path  # [depth + 1]
            dest = runner.length + torch.arange(depth + 1, device=runner.device)
            storage.keys.index_copy_(3, dest, storage.keys.index_select(3, source))
            storage.values.index_copy_(3, dest, storage.values.index_select(3, source))
            storage.positions[0].index_copy_(0, dest, dest)
            runner.draft_features[:, : depth + 1].copy_(features.index_select(1, path))
        runner.length.add_(length)
        return [self.out]

    def _launch(self, bucket: int, slot: int) -> torch.cuda.Event | None:
        key = ("resident", self.drafts, self.budget, bucket, self.capture)
        build: Callable[[], list[torch.Tensor]]
        if self.budget is not None:
            build = lambda: self._tree_round(bucket)  # noqa: E731
        elif self.drafts:
            build = lambda: self._linear_round(bucket)  # noqa: E731
        else:
            build = lambda: self._plain_step(bucket)  # noqa: E731
        state = self._state()
        fresh = self.runner.capture and not self.runner.has_replay(key)
        saved = [t.clone() for t in state] if fresh else None
        replay = self.runner.replay(key, build)
        if saved is not None:  # capturing ran the round once to warm up: undo what it advanced
            for tensor, value in zip(state, saved, strict=True):
                tensor.copy_(value)
        replay.run()
        self.runner.served += 1
        self.launched += 1
        self.host[slot].copy_(self.out, non_blocking=True)
        if self.runner.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def decode(
        self,
        start: int,
        sink: OutputSink,
        stats: GenerationStats,
        should_stop: Callable[[], bool] | None = None,
    ) -> None:
        """Run rounds from the loaded state (`start` = committed target slots) until the sink finishes or
        `should_stop` says so. The caller checked `fits(start, max_new_tokens)`."""
        runner = self.runner
        queued: deque[tuple[int, torch.cuda.Event | None]] = deque()
        known_start, launched, finished = start, 0, False
        try:
            while not finished:
                while len(queued) < QUEUED_ROUNDS and len(sink.token_ids) + len(queued) < sink.max_new_tokens:
                    if should_stop is not None and should_stop():
                        sink.finish_cancelled()
                        return
                    # every queued round may add up to drafts + 1 slots before this one runs
                    reach = known_start + len(queued) * (self.drafts + 1) + self.reach
                    assert reach <= runner.capacity, "resident rounds past the runner's storage"
                    slot = launched % QUEUED_ROUNDS
                    queued.append((slot, self._launch(runner.bucket_for(reach), slot)))
                    launched += 1
                if not queued:  # the sink holds max tokens already
                    return
                slot, event = queued.popleft()
                if event is not None:
                    event.synchronize()
                accepted = int(self.host[slot][0])
                tokens = self.host[slot][1 : accepted + 2].tolist()
                known_start += accepted + 1
                if self.drafts:
                    stats.record_round(self.drafts if self.budget is None else self.budget, accepted)
                finished = sink.push_many(tokens)
        finally:
            for _, event in queued:  # the dropped round still writes into this decoder's host buffers
                if event is not None:
                    event.synchronize()


def resident_decoder(
    runner: GraphRunner,
    chooser: TokenChooser,
    target_cache: KVCache,
    *,
    drafter: DFlashDrafter | None = None,
    drafter_cache: KVCache | None = None,
    drafts: int = 0,
    capture: tuple[int, ...] = (),
    budget: int | None = None,
) -> ResidentDecoder | None:
    """`runner`'s resident decoder for this generation, or None when its rounds cannot serve it: sampling or
    penalties (the host loop applies them), or caches that are not the runner's. The caller also checks `fits`
    and that EOS is no longer suppressed (`chooser.min_tokens`)."""
    if not chooser.params.greedy or chooser.counts is not None:
        return None
    if not target_cache.shares_memory_with(runner.target_storage):
        return None
    if drafts and (
        drafter is None or runner.drafter is not drafter or runner.drafter_storage is None
        or drafter_cache is None or not drafter_cache.shares_memory_with(runner.drafter_storage)
        or padded_rows((drafts if budget is None else budget) + 1) > runner.max_rows
    ):
        return None
    key = (drafts, budget, capture)
    decoder = runner.residents.get(key)
    if decoder is None:  # one per shape: its graphs write into its own output buffer
        decoder = runner.residents[key] = ResidentDecoder(runner, drafts, capture, budget)
    assert isinstance(decoder, ResidentDecoder)
    return decoder
