"""The batched engine core: admits requests, prefills them in chunks between decoding steps, and runs one batched
step at a time over every active request.

A step: (1) sequences whose client went away end; (2) waiting sequences are admitted while fewer than `max_batch`
are active and the pools can hold them (all the memory a sequence may need is reserved on admission, so a running
sequence never waits for memory or loses work); (3) prefill chunks are taken, up to one chunk of tokens; (4) one
drafter round for every speculating sequence; (5) DDTree trees and linear blocks are built; (6) one packed target
pass over the prefill chunks, plain steps, verification blocks and trees of all sequences; (7) each sequence
chooses, accepts, commits or rolls back on its own, exactly as a single-request generation would.

On a GPU two kinds of step are launched one ahead of reading their results, so the host's commits overlap the GPU:
plain steps (`dflash.batch.overlap`) and DDTree rounds (greedy or sampled; greedy linear rounds as one-path trees)
built entirely on the device (`dflash.batch.device_trees`).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np
import torch

from dflash.batch.device_sampling import choose_step_rows, sample_tree_rows
from dflash.batch.device_trees import DeviceTrees, LaunchedRound, RoundResult, TreeShape
from dflash.batch.draft_pass import DraftRows, absorb_context_rows, run_drafter, run_selector
from dflash.batch.overlap import Launched, OverlappedSteps
from dflash.batch.padded import PaddedShape
from dflash.batch.policy import RoundPlan, SpeculationPolicy
from dflash.batch.pool import BlockPool, SlotTable
from dflash.batch.sequence import Sequence
from dflash.batch.target_pass import TargetOutput, TargetRows, run_target
from dflash.batch.tree_budgets import TreeBudgetChooser, candidate_budgets, candidate_chains
from dflash.drafter.dflash2 import DFlash2Drafter
from dflash.drafter.model import DFlashDrafter
from dflash.drafter.selector import CandidateLattice
from dflash.drafter.vocab import DraftScores
from dflash.environment import batch_overlap_enabled, device_trees_enabled
from dflash.errors import GenerationError
from dflash.fastpath.capture import captures_made
from dflash.generation.cached_prefill import prefix_cache_usable
from dflash.generation.selection import TokenChooser
from dflash.host_copies import to_device
from dflash.kv.prefix_cache import PrefixCache, restorable
from dflash.models.gated_deltanet import new_recurrent_states
from dflash.models.model import CausalLM
from dflash.speculative.ddtree import tree_choices
from dflash.speculative.selector_tree import selector_tree
from dflash.speculative.tree import (
    DraftTree,
    accepted_tokens,
    build_tree,
    follow_tree,
    linear_chain_tree,
    topk_log_probs,
    tree_from_candidates,
    tree_verify_inputs,
)

if TYPE_CHECKING:
    from dflash.batch.graphs import GraphedDrafterPasses, GraphedTargetPasses

log = logging.getLogger("dflash.batch")

POOL_BLOCK_TOKENS = 16
_FIRST_ROW = slice(0, 1)


@dataclass
class _Round:
    """One decoding sequence's part of a step."""

    seq: Sequence
    kind: str  # "plain" | "linear" | "tree"
    outputs: int = 0  # draft rows asked of the drafter (0: the drafter does not run for it)
    budget: int = 0  # tree nodes (tree rounds)
    drafts: list[int] | None = None  # linear
    tree: DraftTree | None = None  # tree (plain rounds use a root-only tree)
    rows: TargetRows | None = None
    greedy: bool = False  # its choice is the plain argmax of each row (`_plain_greedy`, set once per step)


@dataclass(frozen=True)
class _FirstToken:
    """A prompt's first token, chosen on the device and copied back without waiting (read later in the step)."""

    seq: Sequence
    host: torch.Tensor  # [1] (pinned, from a GPU)
    event: torch.cuda.Event | None  # recorded after the copy from a GPU


@dataclass(frozen=True)
class CoreSettings:
    max_batch: int
    prefill_chunk: int
    pool_tokens: int  # target (and drafter) positions the pools hold, over every request
    ddtree_budget: int
    linear_drafts: int
    max_step_rows: int
    draft_window: int | None = None
    cuda_graphs: bool = False  # on a CUDA device, replay the decoding rows' target pass as graphs
    prefill_chunks_per_step: int = 1  # prompt chunks a step may prefill (more where a chunk costs little: GPUs)
    # the decoding rows through the fixed-shape passes of `cuda_graphs`, run eagerly on any device: the CUDA path's
    # host work, tested and measured on the CPU
    eager_padded: bool = False
    # plain steps through those passes launched one ahead of reading their tokens (`dflash.batch.overlap`)
    overlap: bool = True


class BatchCore:
    def __init__(
        self,
        target: CausalLM,
        drafter: DFlashDrafter | None,
        eos_ids: tuple[int, ...],
        settings: CoreSettings,
        prefix_cache: PrefixCache | None = None,
    ) -> None:
        self.target, self.drafter, self.settings, self.prefix_cache = target, drafter, settings, prefix_cache
        self.eos_ids = eos_ids
        weight = target.embed_tokens.weight
        blocks = -(-settings.pool_tokens // POOL_BLOCK_TOKENS)
        config = target.layer_config
        # rows only for the layers that keep K/V (not a hybrid's linear layers, nor Gemma 4's K/V-sharing ones),
        # each as wide as the widest layer
        self.target_pool = BlockPool(
            config.cache_layers, config.cache_kv_heads, config.cache_head_dim, blocks, POOL_BLOCK_TOKENS,
            dtype=weight.dtype, device=weight.device,
        )
        self.drafter_pool: BlockPool | None = None
        if drafter is not None:
            d = drafter.config
            self.drafter_pool = BlockPool(
                d.num_layers, d.num_kv_heads, d.head_dim, blocks, POOL_BLOCK_TOKENS,
                dtype=drafter.fc.weight.dtype, device=drafter.fc.weight.device,
            )
        block = drafter.config.block_size if drafter is not None else 1
        self.policy = SpeculationPolicy(
            settings.ddtree_budget, min(settings.linear_drafts, block - 1), settings.max_step_rows
        )
        self.tree_budgets = TreeBudgetChooser()  # steps of device-round DDTree requests only (`_tree_option`)
        self.chain_lengths = TreeBudgetChooser()  # steps of greedy linear requests on the device, by chain length
        self._option_memo: tuple[tuple[int, tuple[int, ...]], int] | None = None
        self._step_index = 0
        # the last step's start, its (request bucket, tree option) if the chooser decided it, and whether a prompt
        # chunk ran in it: the time to the next step's start is that option's cost (`_account_step`)
        self._step_started = 0.0
        self._step_choice: tuple[TreeBudgetChooser, int, int] | None = None  # (chooser, bucket, option)
        self._step_prefilled = False
        self._step_captures = captures_made()  # graphs captured before the last step began
        self._last_step_captured = False
        # steps by kind (the device's launched-ahead and loaded rounds, launched-ahead plain steps, steps with a
        # prompt chunk, other host-built steps) -> [steps, seconds to the next step's start]: where the time goes
        self._step_kind: str | None = None
        self.step_kinds: dict[str, list[float]] = {}
        self.capture = tuple(drafter.config.target_layer_ids) if drafter is not None else ()
        self.graphs: GraphedTargetPasses | None = None
        self.drafter_graphs: GraphedDrafterPasses | None = None
        # graphs keep no recurrent state (hybrids) and cannot replay data-dependent work (`CausalLM.capturable`);
        # experts (capturable on a GPU in 16-bit) are not yet checked through the padded passes: they step packed
        graphed = settings.cuda_graphs and weight.is_cuda
        padded = target.capturable and not target.config.is_hybrid and not target.config.is_moe
        if (graphed or settings.eager_padded) and padded:
            from dflash.batch.graphs import GraphedDrafterPasses, GraphedTargetPasses

            memory = torch.cuda.graph_pool_handle() if graphed else None
            self.graphs = GraphedTargetPasses(
                target, self.target_pool, self.capture, settings.max_batch, memory=memory, graphed=graphed
            )
            if drafter is not None and self.drafter_pool is not None:
                self.drafter_graphs = GraphedDrafterPasses(
                    drafter, target, self.drafter_pool, settings.max_batch, memory, graphed=graphed,
                    fused=not isinstance(drafter, DFlash2Drafter),
                )
        # DDTree steps (and greedy linear steps) with their trees built on the device (`dflash.batch.device_trees`)
        self.device_trees: DeviceTrees | None = None
        if (
            self.graphs is not None and self.drafter_graphs is not None and drafter is not None
            and self.drafter_pool is not None and not isinstance(drafter, DFlash2Drafter)
            and settings.draft_window is None and device_trees_enabled()
        ):
            self.device_trees = DeviceTrees(
                drafter, self.graphs.graphs.forward, self.drafter_graphs.graphs.forward, self.target_pool,
                self.drafter_pool, drafter.config.feature_size, settings.max_batch, config.vocab_size,
                memory=memory, graphed=graphed, sliding_window=target.sliding_window,
                fused_drafter=(target, self.drafter_graphs.fused) if self.drafter_graphs.fused is not None else None,
                context_stores=self.drafter_graphs.context,
                within=tuple(sorted({
                    b for d in range(2, settings.max_batch + 1) for chain in (False, True)
                    for b in self._budgets_for(d, chain)
                })),
            )
        self.overlap: OverlappedSteps | None = None
        if self.graphs is not None and settings.overlap and batch_overlap_enabled():
            self.overlap = OverlappedSteps(self.graphs, settings.max_batch, weight.device)
        self.waiting: deque[Sequence] = deque()
        self.active: list[Sequence] = []
        # while a list: the prompts finished in this step, their first token not read yet (`_read_first`)
        self._first_tokens: list[_FirstToken] | None = None
        self.last_batch = 0

    # ---- admission ---------------------------------------------------------------------------------------
    def positions_needed(self, seq: Sequence) -> int:
        """Target positions a sequence may write: its prompt and output plus the rows of one round past them (a
        resumed sequence's prompt holds its output so far)."""
        block = self.drafter.config.block_size if self.drafter is not None else 1
        rows = max(self.settings.ddtree_budget, block) + 1 if seq.speculative else 1
        return seq.prompt_length + seq.request.max_new_tokens - seq.resumed + rows + 1

    def add_check(self, seq: Sequence) -> None:
        """Refuse a sequence that could never be admitted (it needs more memory than the whole pool)."""
        needed = self.target_pool.blocks_for(self.positions_needed(seq))
        if needed > self.target_pool.num_blocks:
            raise GenerationError(
                f"the request needs {self.positions_needed(seq)} positions of K/V memory, more than the "
                f"{self.target_pool.num_blocks * self.target_pool.block_size} the engine holds"
            )

    def add(self, seq: Sequence) -> None:
        self.add_check(seq)
        self.waiting.append(seq)

    def _admit(self) -> None:
        while self.waiting and len(self.active) < self.settings.max_batch:
            seq = self.waiting[0]
            positions = self.positions_needed(seq)
            pools = [self.target_pool] + ([self.drafter_pool] if seq.speculative and self.drafter_pool else [])
            if any(pool.blocks_for(positions) > pool.free_blocks for pool in pools):
                return  # the oldest waiting request goes first: later ones wait behind it
            self.waiting.popleft()
            seq.target = SlotTable(self.target_pool)
            seq.target.reserve(positions)
            if self.target.config.is_hybrid:
                seq.target.recurrent = new_recurrent_states(self.target.config, self.target.embed_tokens.weight)
            if seq.speculative and self.drafter_pool is not None:
                seq.drafter = SlotTable(self.drafter_pool)
                seq.drafter.reserve(positions)
            seq.phase = "prefill"
            seq.prefill_started = time.perf_counter()
            seq.stats.prompt_tokens = seq.prompt_length - seq.resumed  # the client's prompt
            self._restore_prefix(seq)
            self.active.append(seq)

    def capture_graphs(self, max_keys: int = 4096, *, chains: bool = False) -> int:
        """Capture the decoding pass's graphs ahead of traffic: every request bucket with every row bucket its steps
        can have (plain rows, and the rounds the policy's shares allow that many requests), keys up to `max_keys`,
        and the device rounds of DDTree's trees (`chains`: linear requests' chains). A shape met later is captured
        then, holding up every request of that step. Returns the graphs held."""
        if self.graphs is None:
            return 0
        from dflash.batch.padded import MIN_KEY_BUCKET, ROW_BUCKETS, bucket_up

        block = self.drafter.config.block_size if self.drafter is not None else 1
        rows_of: dict[int, set[int]] = {}  # request bucket -> row buckets
        for decoding in range(1, self.settings.max_batch + 1):
            requests = PaddedShape.bucket_requests(decoding, self.settings.max_batch)
            rows = self.policy.round_rows(decoding) if self.drafter is not None else {1}
            rows_of.setdefault(requests, set()).update(bucket_up(count, ROW_BUCKETS) for count in rows)
        # request bucket -> tree budgets (`chains`: the chain lengths of greedy linear requests, the engine's default
        # mode) of steps where every request drafts
        budgets_of: dict[int, set[int]] = {}
        for decoding in range(1, self.settings.max_batch + 1):
            requests = PaddedShape.bucket_requests(decoding, self.settings.max_batch)
            budgets_of.setdefault(requests, set()).update(self._budgets_for(decoding, chains))
        for requests, rows in sorted(rows_of.items()):
            keys = MIN_KEY_BUCKET
            while keys <= max_keys:
                for count in sorted(rows):
                    self.graphs.ensure(PaddedShape(requests, count, keys))
                if self.drafter_graphs is not None:
                    self.drafter_graphs.graphs.ensure(PaddedShape(requests, bucket_up(block, ROW_BUCKETS), keys))
                if self.device_trees is not None:
                    for budget in sorted(budgets_of.get(requests, ())):
                        self.device_trees.ensure(TreeShape(requests, keys, budget, chains))
                keys *= 2
        drafter = self.drafter_graphs.graphs.captured if self.drafter_graphs is not None else 0
        trees = self.device_trees.captured if self.device_trees is not None else 0
        return self.graphs.captured + drafter + trees

    # ---- the step ----------------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> int:
        """Run one batched step; returns the number of sequences it served (0: nothing to do)."""
        self._step_index += 1
        self._account_step(time.perf_counter())
        # every sequence's `should_stop` is polled once per step (before each of its prefill chunks and rounds)
        for seq in list(self.active):
            if seq.stop_requested():
                self._cancel(seq)
        for seq in [s for s in self.waiting if s.stop_requested()]:
            self.waiting.remove(seq)
            seq.sink.finish_cancelled()
            seq.finish()
        self._admit()
        if self.device_trees is not None and self.device_trees.launched is not None:
            followed = self._follow_device_round()
            if followed is not None:
                self._step_kind = "prefill" if self._step_prefilled else "device_ahead"
                return followed
        if self.overlap is not None:
            plain = self._overlapped_rounds()
            if plain is not None:
                self._step_kind = "plain_ahead"
                return self._overlapped_step(plain)
            self._read_launched()  # this step needs every request's committed state
        if not self.active:
            return 0
        prefills = self._prefill_work()
        self._step_prefilled = bool(prefills)
        self._step_kind = "prefill" if prefills else "host"
        decoders = [s for s in self.active if s.phase == "decode"]
        served = [seq for seq, _, _ in prefills] + decoders
        started = time.perf_counter()
        try:
            rounds = self._plan_rounds(decoders)
            device_round = self._device_tree_step_fits(rounds)
            if device_round:
                self._device_tree_step(rounds)
            else:
                self._draft(rounds)
                items = [self._prefill_rows(seq, lo, hi) for seq, lo, hi in prefills]
                items += self._decoding_rows(rounds)
                for r in rounds:
                    r.greedy = _plain_greedy(r.seq.chooser, r.seq.produced)
                out = self._target_pass(items, len(prefills), any(r.greedy for r in rounds))
        except Exception as exc:  # the step's computation failed: every sequence in it ends with the error
            log.exception("batched step failed")
            for seq in served:
                self._end(seq, exc)
            return len(served)
        if device_round:  # the decoders' round is on the device; the prompt chunks, if any, in a pass of their own
            # (launched after the round: the host queues the chunks' pass while the round runs)
            if prefills:
                self._prefill_alone(prefills)
            else:
                self._step_kind = "device_loaded"
            self.last_batch = len(served)
            return len(served)
        features = out.features
        for index, (seq, lo, hi) in enumerate(prefills):
            self._guarded(seq, self._after_prefill, seq, lo, hi, out.logits[index],
                          features[index] if features is not None else None)
        choices = self._choices(rounds, out, len(prefills))
        for offset, (r, chosen) in enumerate(zip(rounds, choices, strict=True), start=len(prefills)):
            if chosen is not None:
                self._guarded(r.seq, self._after_round, r, out, offset, chosen)
        if not prefills and captures_made() == self._step_captures:
            # a decoding step's cost (prompt chunks cost what their length does, not what rows do; a capture is
            # a first use's)
            rows = sum(item.count for item in items)
            self.policy.costs.observe(rows, any(r.outputs for r in rounds), time.perf_counter() - started)
        self.last_batch = len(served)
        return len(served)

    def _target_pass(self, items: list[TargetRows], prefills: int, greedy: bool) -> TargetOutput:
        """One packed pass; or, through the padded passes (CUDA graphs), the prompt chunks in one eager padded pass
        (packed where they do not fit it) and the decoding rows through a graph. `greedy`: some round chooses by the
        plain argmax (the pass gives every row's on the host)."""
        if self.graphs is None or not items:
            return run_target(self.target, self.target_pool, items, self.capture, argmax=greedy)
        chunks = items[:prefills]
        prefilled = None
        if chunks:
            if self.graphs.prefill_fits(chunks):
                prefilled = self.graphs.prefill(chunks)
            else:
                device = self.target_pool.device
                moved = [replace(c, tokens=to_device(c.tokens, device), positions=to_device(c.positions, device))
                         for c in chunks]
                prefilled = run_target(self.target, self.target_pool, moved, self.capture)
        if len(items) == prefills:
            assert prefilled is not None
            return prefilled
        decoded = self.graphs.run(items[prefills:], argmax=greedy)
        if prefilled is None:
            return decoded
        features = None
        if prefilled.features is not None and decoded.features is not None:
            features = [*prefilled.features, *decoded.features]
        argmax: list[list[int]] | None = None
        if decoded.argmax is not None:
            argmax = [[] for _ in range(prefills)] + decoded.argmax
        return TargetOutput([*prefilled.logits, *decoded.logits], features, argmax)

    def _guarded(self, seq: Sequence, fn: object, *args: object) -> None:
        try:
            fn(*args)  # type: ignore[operator]
        except Exception as exc:  # one sequence's failure (its output callback, say) ends that sequence alone
            log.exception("sequence failed")
            self._end(seq, exc)

    # ---- prefill -----------------------------------------------------------------------------------------
    def _prefill_work(self) -> list[tuple[Sequence, int, int]]:
        """Chunks to prefill this step: up to one chunk of tokens, oldest sequences first, each chunk on its
        prompt's chunk grid (so the prefix cache's blocks stay exact)."""
        chunk = max(1, self.settings.prefill_chunk)
        budget = chunk * self.settings.prefill_chunks_per_step
        work: list[tuple[Sequence, int, int]] = []
        for seq in self.active:
            if seq.phase != "prefill":
                continue
            lo = seq.prefilled
            hi = min(seq.prompt_length, (lo // chunk + 1) * chunk)
            if work and hi - lo > budget:
                break
            work.append((seq, lo, hi))
            budget -= hi - lo
            if budget <= 0:
                break
        return work

    def _prefill_rows(self, seq: Sequence, lo: int, hi: int) -> TargetRows:
        # the padded passes load their rows from the host (`_target_pass` moves them where they run packed)
        device = torch.device("cpu") if self.graphs is not None else self.target_pool.device
        assert seq.target is not None
        last = slice(hi - lo - 1, hi - lo) if hi == seq.prompt_length else slice(0, 0)
        return TargetRows(
            seq.target, torch.tensor(seq.request.prompt_ids[lo:hi], dtype=torch.long, device=device),
            torch.arange(lo, hi, device=device), logit_rows=last,
        )

    def _keeps_features(self, seq: Sequence) -> bool:
        return bool(self.capture) and (seq.speculative or self._cache_for(seq) is not None)

    def _cache_for(self, seq: Sequence) -> PrefixCache | None:
        cache = self.prefix_cache if seq.request.use_prefix_cache else None
        capture = self.capture if seq.speculative else ()
        return cache if prefix_cache_usable(cache, self.settings.prefill_chunk, capture) else None

    def _restore_prefix(self, seq: Sequence) -> None:
        cache = self._cache_for(seq)
        if cache is None:
            return
        assert seq.target is not None
        recurrent = seq.target.recurrent
        blocks = restorable(cache.lookup(seq.request.prompt_ids, limit=seq.prompt_length - 1), recurrent is not None)
        if recurrent is not None:  # keep the state at every block boundary of the prefill, for `_store_prefix`
            recurrent.checkpoint_every = cache.block_tokens
        start = 0
        for block in blocks:
            end = start + len(block.tokens)
            slots = seq.target.slots(start, end)
            self.target_pool.keys[:, :, slots] = block.keys.to(self.target_pool.keys.dtype)
            self.target_pool.values[:, :, slots] = block.values.to(self.target_pool.values.dtype)
            if self._keeps_features(seq) and block.features is not None:
                seq.prompt_features.append(block.features)
            start = end
        last = blocks[-1].recurrent if blocks else None
        if recurrent is not None and last is not None:
            recurrent.restore(last, start)
        seq.target.crop(start)
        seq.prefilled = start
        seq.stats.cached_tokens = min(start, seq.stats.prompt_tokens)

    def _after_prefill(
        self, seq: Sequence, lo: int, hi: int, logits: torch.Tensor, features: torch.Tensor | None
    ) -> None:
        assert seq.target is not None
        seq.target.crop(hi)
        seq.prefilled = hi
        if features is not None and self._keeps_features(seq):
            seq.prompt_features.append(features)
        if hi < seq.prompt_length:
            return
        self._store_prefix(seq)
        if seq.target.recurrent is not None:  # decoding rows may be rolled back: no snapshots of them
            seq.target.recurrent.checkpoint_every = 0
            seq.target.recurrent.checkpoints = {}
        seq.new_features = torch.cat(seq.prompt_features) if seq.speculative and seq.prompt_features else None
        seq.prompt_features = []
        self._absorb_prompt(seq)  # queued before the first token's read below waits for the GPU
        seq.stats.prefill_s = time.perf_counter() - seq.prefill_started
        seq.decode_started = time.perf_counter()
        chosen = seq.chooser.choose(logits, 0)[:1]  # [1]
        if self._first_tokens is None:
            self._start_decoding(seq, int(chosen[0]))
            return
        # read after the step's next launch (`_read_first`)
        host = torch.empty(1, dtype=chosen.dtype, pin_memory=chosen.is_cuda)
        host.copy_(chosen, non_blocking=True)
        event = None
        if chosen.is_cuda:
            event = torch.cuda.Event()
            event.record()
        self._first_tokens.append(_FirstToken(seq, host, event))

    def _start_decoding(self, seq: Sequence, first: int) -> None:
        seq.chooser.observe([first])
        seq.start, seq.pending = seq.prompt_length, first
        seq.phase = "decode"
        if seq.sink.push(first):
            self._end(seq)

    def _read_first(self) -> None:
        """The prompts' first tokens copied back by `_after_prefill` this step: each request starts decoding."""
        firsts, self._first_tokens = self._first_tokens or [], None
        for first in firsts:
            if first.event is not None:
                first.event.synchronize()
            self._guarded(first.seq, self._start_decoding, first.seq, int(first.host[0]))

    def _absorb_prompt(self, seq: Sequence) -> None:
        """The prompt's drafter context but its last block into the drafter pool, as its prefill ends: launched
        while the GPU still runs the step's passes, not when the request's first round loads (which waits for the
        GPU to finish the round before it first). The last block stays: a round's drafter block reads it fresh."""
        features = seq.new_features
        if features is None or seq.drafter is None or self.drafter is None or self.drafter_pool is None:
            return
        excess = features.shape[0] - self.drafter.config.block_size
        if excess <= 0:
            return
        rows = [DraftRows(seq.drafter, features[:excess], 0, 0, 0)]
        if self.drafter_graphs is not None:
            self.drafter_graphs.context.absorb(rows)
        else:
            absorb_context_rows(self.drafter, self.drafter_pool, rows)
        seq.new_features = features[excess:]

    def _store_prefix(self, seq: Sequence) -> None:
        """Keep the full blocks of the prompt positions prefilled so far (whole prompt, or a cancelled part)."""
        cache = self._cache_for(seq)
        assert seq.target is not None
        length = seq.prefilled
        if cache is None or length < cache.block_tokens:
            return
        slots = seq.target.slots(0, length)
        keys = self.target_pool.keys[:, :, slots]  # [layers, kv_heads, length, head_dim]
        values = self.target_pool.values[:, :, slots]
        features = torch.cat(seq.prompt_features)[None] if cache.feature_layers and seq.prompt_features else None
        recurrent = seq.target.recurrent.checkpoints if seq.target.recurrent is not None else None
        cache.store_rows(seq.request.prompt_ids, keys, values, features, recurrent=recurrent)

    # ---- decoding rounds ---------------------------------------------------------------------------------
    def _plan_rounds(self, decoders: list[Sequence]) -> list[_Round]:
        speculating = sum(1 for s in decoders if s.speculative)
        plan = self.policy.share(speculating, plain_rows=len(decoders) - speculating)
        kind = self._device_kind(decoders) if len(decoders) > 1 else None
        if kind is not None:
            option = self._tree_option(decoders, chain=kind == "chain")  # 0: a plain step
            if option == 0:
                return [_Round(seq, "plain") for seq in decoders]
            if kind == "chain":  # chains of `option` drafts (on the device where the step fits it)
                return [_Round(seq, "linear", outputs=option) for seq in decoders]
            rounds = [self._round_for(seq, RoundPlan(option, plan.linear_drafts)) for seq in decoders]
            if any(r.kind != "tree" for r in rounds):  # a request with one token left: a device round serves it too
                drafts = min(self.device_trees.block - 1, option) if self.device_trees is not None else 0
                whole = [_Round(seq, "tree", outputs=drafts, budget=option) for seq in decoders]
                if self._device_tree_step_fits(whole):
                    return whole
            return rounds
        rounds = [self._round_for(seq, plan) for seq in decoders]
        drafting = [r for r in rounds if r.outputs]
        # a request decoding alone keeps its configured strategy (measured as the fastest single stream)
        if len(decoders) > 1 and drafting and not self.policy.plan(
            [r.seq.expected_tokens(self.policy.prior(r.seq.mode)) for r in drafting],
            [r.budget or r.outputs for r in drafting],
            plain_rows=len(rounds) - len(drafting),
        ):  # speculation would not pay in this step: everyone takes a plain step (features kept for later)
            rounds = [_Round(r.seq, "plain") for r in rounds]
        return rounds

    def _account_step(self, now: float) -> None:
        """The previous step's whole cost (to this step's start: its host work, its launch and the wait for the
        round before it) to the option it took, where the chooser decided it, no prompt chunk ran in it and it
        captured no graph (a first use's capture is no measure of the option's steady cost)."""
        spent = now - self._step_started
        captures = captures_made()
        captured, self._step_captures = captures != self._step_captures, captures
        self._last_step_captured = captured
        if self._step_choice is not None and not self._step_prefilled and not captured:
            chooser, bucket, option = self._step_choice
            chooser.observe(bucket, option, spent)
        if self._step_kind is not None:
            totals = self.step_kinds.setdefault(self._step_kind, [0, 0.0])
            totals[0] += 1
            totals[1] += spent
        self._step_started, self._step_choice, self._step_prefilled, self._step_kind = now, None, False, None

    def _budgets_for(self, decoding: int, chain: bool = False) -> list[int]:
        """The tree budgets (`chain`: the chain lengths) a step of `decoding` DDTree (greedy linear) requests may take
        (alone: the configured one); the same for every count of one request bucket (the bucket's row share), so
        that each bucket measures a few."""
        block = self.drafter.config.block_size if self.drafter is not None else 1
        bucket = 1 if decoding == 1 else PaddedShape.bucket_requests(decoding, self.settings.max_batch)
        share = self.policy.share(bucket, plain_rows=0)
        top = min(share.linear_drafts, block - 1) if chain else share.ddtree_budget
        if decoding == 1:
            return [top] if top > 0 else []
        return candidate_chains(top) if chain else candidate_budgets(top)

    def _device_kind(self, decoders: list[Sequence]) -> str | None:
        """"tree" where every decoding request is a DDTree request the device trees serve (greedy, or sampled with
        nothing but its logits and random stream deciding: `_device_choice`), "chain" where every one is a greedy
        linear request (served as one-path trees), else None."""
        if self.device_trees is None or not decoders:
            return None
        mode = decoders[0].mode
        if mode not in ("ddtree", "linear") or not all(
            s.mode == mode and s.feature_rows is not None and _device_choice(s, chain=mode == "linear")
            for s in decoders
        ):
            return None
        return "tree" if mode == "ddtree" else "chain"

    def _tree_option(self, decoders: list[Sequence], chain: bool = False) -> int:
        """This step's tree budget (`chain`: chain length) for `decoders` (0: a plain step), chosen once per step
        (`TreeBudgetChooser`)."""
        key = (self._step_index, tuple(map(id, decoders)))
        if self._option_memo is not None and self._option_memo[0] == key:
            return self._option_memo[1]
        chooser = self.chain_lengths if chain else self.tree_budgets
        bucket = PaddedShape.bucket_requests(len(decoders), self.settings.max_batch)
        option = chooser.choose(
            bucket, len(decoders), self._budgets_for(len(decoders), chain),
            lambda budget: sum(s.expected_tree_tokens(budget, chooser.prior(budget)) for s in decoders),
        )
        self._option_memo = (key, option)
        self._step_choice = (chooser, bucket, option)
        return option

    def _round_for(self, seq: Sequence, plan: RoundPlan) -> _Round:
        block = self.drafter.config.block_size if self.drafter is not None else 1
        if seq.mode == "linear" and plan.linear_drafts > 0:
            return _Round(seq, "linear", outputs=plan.linear_drafts)
        if seq.mode == "ddtree" and plan.ddtree_budget > 0 and block > 1:
            max_depth = min(block - 1, seq.request.max_new_tokens - seq.produced - 1)
            if max_depth > 0:
                return _Round(seq, "tree", outputs=min(block - 1, plan.ddtree_budget), budget=plan.ddtree_budget)
        return _Round(seq, "plain")

    def _draft(self, rounds: list[_Round]) -> None:
        drafting = [r for r in rounds if r.outputs]
        if not drafting:
            return
        assert self.drafter is not None and self.drafter_pool is not None
        items = []
        for r in drafting:
            seq = r.seq
            assert seq.drafter is not None and seq.new_features is not None
            items.append(DraftRows(seq.drafter, seq.new_features, seq.pending, seq.start, r.outputs,
                                   self.settings.draft_window))
        block = self.drafter.config.block_size
        if isinstance(self.drafter, DFlash2Drafter):
            self._select(drafting, run_selector(self.drafter, self.target, self.drafter_pool, items))
            return
        scores = run_drafter(self.drafter, self.target, self.drafter_pool, items, self.drafter_graphs)
        trees = [(r, score) for r, score in zip(drafting, scores, strict=True) if r.kind == "tree"]
        candidates = _tree_candidates(trees)
        chains = _greedy_drafts([(r, score) for r, score in zip(drafting, scores, strict=True) if r.kind == "linear"])
        for r, score in zip(drafting, scores, strict=True):
            r.seq.new_features = r.seq.new_features[:0] if r.seq.new_features is not None else None  # absorbed
            if r.kind == "linear":
                found_chain = chains.get(id(r))
                r.drafts = found_chain if found_chain is not None else score.greedy().tolist()
                continue
            max_depth = min(block - 1, r.seq.request.max_new_tokens - r.seq.produced - 1)
            found = candidates.get(id(r))
            if found is None:
                r.tree = build_tree(score.logits[:max_depth], r.budget, token_ids=score.ids)
            else:
                r.tree = tree_from_candidates(found[0][:max_depth], found[1][:max_depth], r.budget)

    def _select(self, drafting: list[_Round], lattices: list[CandidateLattice]) -> None:
        """DFlash2 drafts: the selector's greedy chain (linear) or a tree grown from it. Verified by the equality
        rule at every temperature (lossless; the q rule of `dflash.speculative.linear` is not used here)."""
        assert self.drafter is not None
        block = self.drafter.config.block_size
        for r, lattice in zip(drafting, lattices, strict=True):
            seq = r.seq
            seq.new_features = seq.new_features[:0] if seq.new_features is not None else None  # absorbed
            if r.kind == "linear":
                r.drafts = lattice.walk(seq.pending).tokens.tolist()
                continue
            max_depth = min(block - 1, seq.request.max_new_tokens - seq.produced - 1)
            r.tree = selector_tree(lattice, seq.pending, r.budget, max_depth)

    def _decoding_rows(self, rounds: list[_Round]) -> list[TargetRows]:
        """Every round's target rows; plain rounds' tokens and positions as views of two tensors built at once."""
        device = torch.device("cpu") if self.graphs is not None else self.target_pool.device  # graphs load from host
        plain = [r for r in rounds if r.kind == "plain"]
        if plain:
            tokens = _long_tensor([r.seq.pending for r in plain], device)  # [plain]
            positions = _long_tensor([r.seq.start for r in plain], device)  # [plain]
            for index, r in enumerate(plain):
                assert r.seq.target is not None
                r.rows = TargetRows(r.seq.target, tokens[index : index + 1], positions[index : index + 1],
                                    logit_rows=_FIRST_ROW)
        rows = []
        for r in rounds:
            if r.rows is None:
                r.rows = self._round_rows(r, device)
            rows.append(r.rows)
        return rows

    def _round_rows(self, r: _Round, device: torch.device) -> TargetRows:
        """A linear round's block or a tree round's nodes (plain rounds: `_decoding_rows`)."""
        seq = r.seq
        assert seq.target is not None
        if r.kind == "linear":
            assert r.drafts is not None
            count = len(r.drafts) + 1
            tokens = _long_tensor([seq.pending, *r.drafts], device)
            positions = _long_tensor(range(seq.start, seq.start + count), device)
            r.rows = TargetRows(seq.target, tokens, positions, logit_rows=slice(0, count))
            return r.rows
        tree = r.tree if r.tree is not None else linear_chain_tree([])
        r.tree = tree
        tokens, positions, visibility = tree_verify_inputs(tree, seq.pending, seq.start, 0, device=device)
        chain = tree.max_depth == tree.num_nodes  # the ancestor mask is the causal one
        r.rows = TargetRows(seq.target, tokens, positions, None if chain else visibility,
                            logit_rows=slice(0, tree.num_nodes + 1))
        return r.rows

    def _choices(self, rounds: list[_Round], out: TargetOutput, first: int) -> list[list[int] | None]:
        """Every round's choices at its logit rows, on the host (None: its sequence failed choosing and ended).

        A plain greedy round takes the pass's host argmax; every other round is chosen on the logits' device (by
        its chooser: constraints, penalties, EOS suppression, the same operations as alone; sampled plain rows that
        only their logits decide, all in one program: `_drawn_plain`) and all of them are read back in one
        transfer, so that a request choosing on the device costs the step no synchronisation of its own. Rounds are
        numbered from `first` in the pass's outputs."""
        choices: list[list[int] | None] = [None] * len(rounds)
        chosen: list[tuple[int, torch.Tensor]] = []  # (round number, its choices [rows] on the logits' device)
        drawn = [number for number, r in enumerate(rounds) if _drawn_plain(r)]
        if drawn:  # sampled plain rows, every request's in one program (as a launched step draws them)
            seqs = [rounds[number].seq for number in drawn]
            try:
                tokens = choose_step_rows(
                    torch.cat([out.logits[first + number][:1] for number in drawn]),  # [requests, vocab]
                    [s.chooser.params for s in seqs], [s.row_seed() for s in seqs], [s.start for s in seqs],
                )
                chosen.extend((number, tokens[index : index + 1]) for index, number in enumerate(drawn))
            except Exception as exc:
                log.exception("choosing failed")
                for seq in seqs:
                    self._end(seq, exc)
        for number, r in enumerate(rounds):
            if r.greedy and out.argmax is not None:
                choices[number] = out.argmax[first + number]
                continue
            if _drawn_plain(r):
                continue
            try:
                chosen.append((number, self._choose(r, out.logits[first + number])))
            except Exception as exc:  # one chooser's failure ends its own sequence alone
                log.exception("sequence failed")
                self._end(r.seq, exc)
        if not chosen:
            return choices
        try:
            flat: list[int] = torch.cat([tokens for _, tokens in chosen]).tolist()  # [sum of rows]
        except Exception as exc:
            log.exception("choosing failed")
            for number, _ in chosen:
                self._end(rounds[number].seq, exc)
            return choices
        row = 0
        for number, tokens in chosen:
            count = int(tokens.shape[0])
            choices[number] = flat[row : row + count]
            row += count
        return choices

    def _choose(self, r: _Round, logits: torch.Tensor) -> torch.Tensor:
        """A round's choices by its chooser: logits [rows, vocab] -> tokens [rows], left on their device."""
        seq = r.seq
        if r.kind == "plain":
            return seq.chooser.choose(logits, seq.produced)  # [1]
        if r.kind == "linear":
            assert r.drafts is not None
            allowed = seq.chooser.allowed(r.drafts) if seq.chooser.constrained else None
            return seq.chooser.choose(logits, seq.produced, allowed)  # [k+1]
        assert r.tree is not None
        if not seq.chooser.params.greedy and _choice_stateless(seq.chooser, seq.produced):
            # the rows a device round would sample, with the same uniforms: the same tokens either way
            depths = r.tree.host.depths if r.tree.host is not None else r.tree.depths.tolist()
            positions = [seq.start, *(seq.start + d for d in depths)]
            return sample_tree_rows(logits, seq.chooser.params, seq.row_seed(), positions)  # [n+1]
        return tree_choices(seq.chooser, logits, r.tree, seq.produced)  # [n+1]

    def _after_round(self, r: _Round, out: TargetOutput, index: int, choices: list[int]) -> None:
        """Accept and commit (or roll back) a round from the target's `choices` at its rows (`_choices`) and its
        rows of the target pass `out` (request `index`): plain Python on the host, but for a tree path's rows."""
        seq = r.seq
        assert seq.target is not None
        rows: torch.Tensor | None = None  # the kept tree rows, where they are not the first `kept`
        if r.kind == "plain":
            committed, kept = [choices[0]], 1
            if seq.mode == "ddtree":  # a root-only tree, counted as a round as the single-request loop does
                seq.stats.record_round(0, 0)
            seq.target.crop(seq.start + 1)
        elif r.kind == "linear":
            assert r.drafts is not None
            accepted = _matching_prefix(r.drafts, choices)
            committed = [*r.drafts[:accepted], choices[accepted]]
            self._record_drafted(seq, len(r.drafts), accepted)
            seq.target.crop(seq.start + accepted + 1)
            kept = accepted + 1
        else:
            assert r.tree is not None
            visited, bonus = follow_tree(r.tree, choices)
            committed = [*accepted_tokens(r.tree, visited), bonus]
            if r.tree.num_nodes:
                self._record_drafted(seq, r.tree.num_nodes, len(visited) - 1)
                if r.budget:
                    self._record_tree(seq, r.budget, len(visited), {})
            elif seq.mode == "ddtree":  # a root-only tree, counted as a round as the single-request loop does
                seq.stats.record_round(0, 0)
            kept = len(visited)
            if visited[-1] == kept - 1:  # the path is nodes 0 .. kept-1 (parents precede children)
                seq.target.crop(seq.start + kept)
            else:
                rows = torch.tensor(visited, dtype=torch.long, device=self.target_pool.device)
                seq.target.compact(seq.start, rows + seq.start)
        kept_features = None
        if seq.speculative and out.features is not None:
            features = out.features[index]  # [n, F]
            kept_features = features[:kept] if rows is None else features[rows.to(features.device)]
        seq.start += kept
        self._commit(seq, committed, kept_features)

    def _record_drafted(self, seq: Sequence, drafted: int, accepted: int) -> None:
        seq.record_drafted_round(drafted, accepted)
        self.policy.record_round(seq.mode, accepted + 1)

    def _record_tree(
        self, seq: Sequence, budget: int, tokens: int, within: dict[int, int], chain: bool = False
    ) -> None:
        seq.record_tree_round(budget, tokens, within)
        (self.chain_lengths if chain else self.tree_budgets).record(budget, tokens, within)

    def _commit(self, seq: Sequence, committed: list[int], kept_features: torch.Tensor | None) -> None:
        """A round's committed tokens (its K/V rows already kept): the drafter's new context, the next pending
        token, the chooser's history and the output."""
        if kept_features is not None:
            seq.keep_features(kept_features)
        seq.pending = committed[-1]
        seq.chooser.observe(committed)
        if seq.sink.push_many(committed):
            self._end(seq)

    # ---- DDTree steps built on the device (`dflash.batch.device_trees`) -----------------------------------
    def _device_tree_step_fits(self, rounds: list[_Round], *, ahead: bool = False) -> bool:
        """Whether this step's rounds go through the device trees: every one a tree round of one budget (greedy or
        sampled on the device), or every one a greedy linear round of one draft count (a chain), each request's
        round writing only positions it reserved (`ahead`: the round starts after the unread one, up to depth + 1
        positions later). A round may draft past a request's last token: its sink keeps only what the request
        asked for."""
        trees = self.device_trees
        found = _device_round(rounds)
        if trees is None or found is None:
            return False
        size, chain = found
        depth = trees.depth(size)
        if chain and depth != size:
            return False
        # the furthest position a round writes past its start: tree rows to depth, the drafter block to block - 1
        reach = max(depth, trees.block - 1) + (depth + 1 if ahead else 0)
        for r in rounds:
            seq = r.seq
            if seq.feature_rows is None or not _device_choice(seq, chain=chain):
                return False
            if seq.start + reach >= self.positions_needed(seq):
                return False
        return True

    def _device_tree_step(self, rounds: list[_Round]) -> int:
        """Launch this step's round from the committed state; it is read at the next step."""
        assert self.device_trees is not None
        found = _device_round(rounds)
        assert found is not None
        self.device_trees.launch([r.seq for r in rounds], found[0], chain=found[1])
        self.last_batch = len(rounds)
        return len(rounds)

    def _follow_device_round(self) -> int | None:
        """Where the unread device round's requests (less those that ended) are this step's only decoding ones and
        go on with the same shape: run any prompt chunk due in a pass of its own (a request in its prompt does not
        break the chain), launch their next round from the state the unread one leaves on the device, then read and
        commit that one (the host's work overlaps the GPU's), and last read the first token of each prompt that
        ended. Otherwise read and commit it, and return None: the step goes on from the committed state."""
        trees = self.device_trees
        assert trees is not None and trees.launched is not None
        seqs = trees.launched.seqs  # in the launched round's order, requests that ended since included
        live = [s for s in seqs if s.phase != "done"]
        rounds: list[_Round] = []
        decoding = [s for s in self.active if s.phase == "decode"]
        same = live and len(decoding) == len(live) and all(a is b for a, b in zip(decoding, live, strict=True))
        # ended requests' slots ride as padding while the others fill the same request bucket
        if same and PaddedShape.bucket_requests(len(live), self.settings.max_batch) == trees.launched.shape.requests:
            rounds = self._plan_rounds(decoding)
        found = _device_round(rounds)
        size, chain = found if found is not None else (0, False)
        if not (self._device_tree_step_fits(rounds, ahead=True) and trees.can_follow(seqs, size, chain)):
            unread = trees.take()
            assert unread is not None
            self._commit_device_round(unread)
            return None
        # prompt chunks due go first, their first tokens copied back without waiting: the host reads them after
        # launching the next round and committing the last, so it does not wait for the next round to run
        prefills = self._prefill_work()
        self._first_tokens = []
        try:
            if prefills:
                self._step_prefilled = True
                self._prefill_alone(prefills)
            try:
                # an ended request's slot rides as padding until the requests change (no chain break at its end)
                ended = [index for index, seq in enumerate(seqs) if seq.phase == "done"]
                previous = trees.launch(seqs, size, chain=chain, follow=True, ended=ended)
            except Exception as exc:  # the launch failed: its requests end with the error (the unread round too)
                log.exception("batched step failed")
                trees.take()
                for seq in seqs:
                    self._end(seq, exc)
                return len(seqs) + len(prefills)
            assert previous is not None
            self._commit_device_round(previous)
        finally:
            self._read_first()
        self.last_batch = len(seqs) + len(prefills)
        return self.last_batch

    def _prefill_alone(self, prefills: list[tuple[Sequence, int, int]]) -> None:
        """Prompt chunks in a pass of their own (the decoding requests' round is on the device)."""
        try:
            out = self._target_pass([self._prefill_rows(seq, lo, hi) for seq, lo, hi in prefills], len(prefills), False)
        except Exception as exc:  # the chunks' computation failed: their sequences end with the error
            log.exception("batched step failed")
            for seq, _, _ in prefills:
                self._end(seq, exc)
            return
        features = out.features
        for index, (seq, lo, hi) in enumerate(prefills):
            self._guarded(seq, self._after_prefill, seq, lo, hi, out.logits[index],
                          features[index] if features is not None else None)

    def _commit_device_round(self, launched: LaunchedRound) -> None:
        """Read a launched device round and commit it (a request that ended since is skipped). Its cost is measured
        by the tree-budget choice (`_account_step`), not the policy's fit of host-built steps."""
        assert self.device_trees is not None
        try:
            results = self.device_trees.read(launched)
        except Exception as exc:
            log.exception("batched step failed")
            for seq in launched.seqs:
                self._end(seq, exc)
            return
        shape = launched.shape
        for seq, result in zip(launched.seqs, results, strict=True):
            if seq.phase != "done":
                self._guarded(seq, self._after_device_round, seq, shape.budget, result, shape.chain)

    def _after_device_round(self, seq: Sequence, budget: int, result: RoundResult, chain: bool = False) -> None:
        """Commit a device round: its K/V rows were moved on the device; the table keeps them, the drafter has read
        the context before the round's start, its next context is the round's rows."""
        assert seq.target is not None and seq.drafter is not None
        self._record_drafted(seq, budget, result.accepted)
        self._record_tree(seq, budget, result.accepted + 1, result.within, chain)
        kept = result.accepted + 1
        seq.target.crop(seq.start + kept)
        seq.drafter.crop(seq.start)
        seq.start += kept
        seq.new_features = None
        self._commit(seq, result.tokens, result.features)

    # ---- overlapped plain steps (`dflash.batch.overlap`) -------------------------------------------------
    def _overlapped_rounds(self) -> list[_Round] | None:
        """This step's rounds when it can be launched ahead: every active request decoding, each taking a plain
        step whose choice depends on nothing chosen before (`_choice_stateless`), all of them in the launched step
        or none; None otherwise."""
        assert self.overlap is not None
        decoders = self.active
        if not decoders or any(s.phase != "decode" for s in decoders) or not self.overlap.takes(decoders):
            return None
        rounds = self._plan_rounds(decoders)
        for r in rounds:
            if r.kind != "plain" or not _choice_stateless(r.seq.chooser, self.overlap.produced(r.seq)):
                return None
        return rounds

    def _overlapped_step(self, rounds: list[_Round]) -> int:
        """Launch this step's plain rows, then read and commit the step launched before it."""
        assert self.overlap is not None
        now = time.perf_counter()
        # a request whose in-flight token is its last allowed one gets no further row
        launch = [r for r in rounds if self.overlap.produced(r.seq) < r.seq.request.max_new_tokens]
        previous = self.overlap.launched
        if launch:
            seqs = [r.seq for r in launch]
            try:
                previous = self.overlap.launch(seqs, self._decoding_rows(launch), now, self._chooser_for(seqs))
            except Exception as exc:  # the launch failed: its requests and the unread step's end with the error
                log.exception("batched step failed")
                unread = self.overlap.take()
                for seq in {id(s): s for s in [*seqs, *(unread.seqs if unread else [])]}.values():
                    self._end(seq, exc)
                return len(rounds)
            for seq in seqs:  # a plain row is kept whatever its token: the position advances now
                assert seq.target is not None
                seq.target.crop(seq.start + 1)
                seq.start += 1
        else:
            self.overlap.take()
        if previous is not None:
            if launch and not self._last_step_captured:
                # consecutive launches: the time between them (the last step) is what a plain step costs here
                self.policy.costs.observe(len(previous.seqs), False, now - previous.launched_at)
            self._commit_launched(previous)
        self.last_batch = len(rounds)
        return len(rounds)

    def _chooser_for(self, seqs: list[Sequence]) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """How the launched step chooses its requests' tokens: None where all of them take the plain argmax; else
        logits [requests, vocab] -> tokens [requests] on the device, every request at once: the argmax for greedy
        ones, for sampled ones the draw of (its seed, its row's position) that the synchronous step makes
        (`dflash.batch.device_sampling.choose_step_rows`). Every request here chooses from its logits alone (the
        overlap's condition)."""
        assert self.overlap is not None
        if all(s.chooser.params.greedy for s in seqs):
            return None
        params = [s.chooser.params for s in seqs]
        seeds = [s.row_seed() for s in seqs]
        positions = [s.start for s in seqs]  # each request's row (its position advances after the launch)
        return lambda logits: choose_step_rows(logits, params, seeds, positions)

    def _read_launched(self) -> None:
        launched = self.overlap.take() if self.overlap is not None else None
        if launched is not None:
            self._commit_launched(launched)

    def _commit_launched(self, launched: Launched) -> None:
        """Read a launched step's tokens and commit them (a request that ended since is skipped: its row is
        discarded)."""
        try:
            tokens = launched.tokens()
        except Exception as exc:
            log.exception("batched step failed")
            for seq in launched.seqs:
                self._end(seq, exc)
            return
        for index, (seq, token) in enumerate(zip(launched.seqs, tokens, strict=True)):
            if seq.phase == "done":
                continue
            if seq.mode == "ddtree":  # a root-only tree, counted as a round as the single-request loop does
                seq.stats.record_round(0, 0)
            features = launched.features[index] if seq.speculative and launched.features is not None else None
            self._guarded(seq, self._commit, seq, [token], features)

    # ---- ending ------------------------------------------------------------------------------------------
    def _cancel(self, seq: Sequence) -> None:
        if seq.phase == "prefill":
            self._store_prefix(seq)  # the completed chunks serve a resend of the same prompt
        seq.sink.finish_cancelled()
        self._end(seq)

    def _end(self, seq: Sequence, error: BaseException | None = None) -> None:
        if seq in self.active:
            self.active.remove(seq)
        seq.finish(error)

    def fail_all(self, error: BaseException) -> None:
        """End every sequence, waiting or active, with `error` (the loop is going down)."""
        if self.overlap is not None:
            self.overlap.take()
        if self.device_trees is not None:
            self.device_trees.take()
        for seq in [*self.active, *self.waiting]:
            seq.finish(error)
        self.active.clear()
        self.waiting.clear()


def _device_round(rounds: list[_Round]) -> tuple[int, bool] | None:
    """(tree budget, False) where every round is a tree round of that budget, (draft count, True) where every one is
    a linear round of that many drafts (a chain on the device), else None."""
    if not rounds:
        return None
    kind = rounds[0].kind
    size = rounds[0].budget if kind == "tree" else rounds[0].outputs
    if kind not in ("tree", "linear") or size <= 0:
        return None
    if any(r.kind != kind or (r.budget if kind == "tree" else r.outputs) != size for r in rounds):
        return None
    return size, kind == "linear"


def _device_choice(seq: Sequence, *, chain: bool) -> bool:
    """Whether a device round can choose `seq`'s tokens: a tree's rows greedy or sampled on the device
    (`dflash.batch.device_sampling`), a chain's greedy only (a sampled chain is verified on the host, by the draft
    distribution's rule, which accepts more than matching a sample)."""
    if chain:
        return _plain_greedy(seq.chooser, seq.produced)
    return _choice_stateless(seq.chooser, seq.produced)


def _drawn_plain(r: _Round) -> bool:
    """Whether `r` is a sampled plain round that only its logits and seed decide: drawn with the others of its step
    (`_choices`) by the uniforms of its seed and position, as a launched plain step draws it (`_chooser_for`)."""
    seq = r.seq
    return r.kind == "plain" and not seq.chooser.params.greedy and _choice_stateless(seq.chooser, seq.produced)


def _plain_greedy(chooser: TokenChooser, produced: int) -> bool:
    """Whether the chooser's choice for output tokens from `produced` on is the plain argmax of each row."""
    return chooser.params.greedy and _choice_stateless(chooser, produced)


def _choice_stateless(chooser: TokenChooser, produced: int) -> bool:
    """Whether the chooser's choice for output tokens from `produced` on depends only on the logits and its random
    stream, not on the tokens chosen before (no constraint, no penalties, no EOS suppression left): a launched step
    can choose before the previous one's tokens are read (`dflash.batch.overlap`)."""
    return (
        chooser.constraint is None and chooser.counts is None and chooser.agreement is None
        and (chooser.min_tokens <= produced or not chooser.has_eos)
    )


def _matching_prefix(drafts: list[int], choices: list[int]) -> int:
    """How many leading drafts equal the target's choices at their rows
    (`dflash.speculative.acceptance.accepted_prefix_length` on lists)."""
    accepted = 0
    for draft, choice in zip(drafts, choices, strict=False):  # one choice more than drafts: the bonus row
        if draft != choice:
            break
        accepted += 1
    return accepted


def _long_tensor(values: Iterable[int], device: torch.device) -> torch.Tensor:
    """int64 [len(values)] on `device`, built through numpy (torch.tensor of a Python list costs several times
    more)."""
    host = torch.from_numpy(np.fromiter(values, dtype=np.int64))
    return host if device.type == "cpu" else to_device(host, device)


def _greedy_drafts(chains: list[tuple[_Round, DraftScores]]) -> dict[int, list[int]]:
    """The greedy drafts of every linear round whose draft scores share one shape and columns, from one argmax and
    one host transfer (instead of one per request): {id(round): drafts}."""
    if len(chains) < 2:
        return {}
    shapes = {tuple(score.logits.shape) for _, score in chains}
    ids = {id(score.ids) for _, score in chains}
    if len(shapes) != 1 or len(ids) != 1:
        return {}
    first = chains[0][1]
    stacked = DraftScores(torch.stack([score.logits for _, score in chains]), first.ids, first.vocab_size)  # [n, k, cols]
    drafts: list[list[int]] = stacked.greedy().tolist()  # [n, k]
    return {id(r): row for (r, _), row in zip(chains, drafts, strict=True)}


def _tree_candidates(trees: list[tuple[_Round, DraftScores]]) -> dict[int, tuple[list[list[float]], list[list[int]]]]:
    """Per-depth top-k candidates of every tree round whose draft scores share one shape, from one top-k over all
    of them and one host transfer (instead of one per request): {id(round): (log-probabilities, token ids)}."""
    if len(trees) < 2:
        return {}
    shapes = {tuple(score.logits.shape) for _, score in trees}
    budgets = {r.budget for r, _ in trees}
    if len(shapes) != 1 or len(budgets) != 1 or any(score.ids is not None for _, score in trees):
        return {}
    stacked = torch.stack([score.logits for _, score in trees])  # [trees, depth, vocab]
    k = min(budgets.pop(), stacked.shape[-1])
    top_lp, top_ids = topk_log_probs(stacked.flatten(0, 1), k)  # [trees * depth, k]
    depth = stacked.shape[1]
    if stacked.shape[-1] <= 1 << 24:  # ids exact in float64: one transfer for both
        both = torch.stack((top_lp.double(), top_ids.double())).view(2, len(trees), depth, k).cpu()
        lp, ids = both[0].tolist(), both[1].long().tolist()
    else:
        lp = top_lp.view(len(trees), depth, k).cpu().tolist()
        ids = top_ids.view(len(trees), depth, k).cpu().tolist()
    return {id(r): (lp[i], ids[i]) for i, (r, _) in enumerate(trees)}
