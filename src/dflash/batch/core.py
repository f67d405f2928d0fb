"""The batched engine core: admits requests, prefills them in chunks between decoding steps, and runs one batched
step at a time over every active request.

A step: (1) sequences whose client went away end; (2) waiting sequences are admitted while fewer than `max_batch`
are active and the pools can hold them (all the memory a sequence may need is reserved on admission, so a running
sequence never waits for memory or loses work); (3) prefill chunks are taken, up to one chunk of tokens; (4) one
drafter round for every speculating sequence; (5) DDTree trees and linear blocks are built; (6) one packed target
pass over the prefill chunks, plain steps, verification blocks and trees of all sequences; (7) each sequence
chooses, accepts, commits or rolls back on its own, exactly as a single-request generation would.

On a GPU two kinds of step are launched one ahead of reading their results, so the host's commits overlap the GPU:
plain steps (`dflash.batch.overlap`) and DDTree rounds (greedy or sampled; linear rounds as one-path trees)
built entirely on the device (`dflash.batch.device_trees`).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from dflash.batch.core_settings import CoreSettings
from dflash.batch.device_sampling import choose_step_rows, sample_tree_rows
from dflash.batch.device_steps import DeviceRoundSteps
from dflash.batch.device_trees import DeviceTrees, TreeShape
from dflash.batch.draft_pass import DraftRows, run_drafter, run_selector
from dflash.batch.overlap import OverlappedSteps
from dflash.batch.padded import PaddedShape
from dflash.batch.plain_ahead import PlainAheadSteps
from dflash.batch.policy import RoundPlan, SpeculationPolicy
from dflash.batch.pool import BlockPool, SlotTable
from dflash.batch.prompt_steps import PromptSteps
from dflash.batch.rounds import (
    FirstToken,
    Round,
    choice_stateless,
    drawn_plain,
    greedy_drafts,
    long_tensor,
    matching_prefix,
    plain_greedy,
    tree_candidates,
)
from dflash.batch.sequence import Sequence
from dflash.batch.speculation_pause import PAUSE_BELOW, SpeculationPause
from dflash.batch.target_pass import TargetOutput, TargetRows, run_target
from dflash.batch.tree_budgets import TreeBudgetChooser
from dflash.drafter.dflash2 import DFlash2Drafter
from dflash.drafter.model import DFlashDrafter
from dflash.drafter.selector import CandidateLattice
from dflash.environment import batch_overlap_enabled, device_trees_enabled
from dflash.errors import GenerationError
from dflash.fastpath.capture import captures_made
from dflash.host_copies import to_device
from dflash.kv.prefix_cache import PrefixCache
from dflash.models.gated_deltanet import new_recurrent_states
from dflash.models.model import CausalLM
from dflash.speculative.ddtree import tree_choices
from dflash.speculative.selector_tree import selector_tree
from dflash.speculative.tree import (
    accepted_tokens,
    build_tree,
    follow_tree,
    linear_chain_tree,
    tree_from_candidates,
    tree_verify_inputs,
)

if TYPE_CHECKING:
    from dflash.batch.graphs import GraphedDrafterPasses, GraphedTargetPasses

__all__ = ["POOL_BLOCK_TOKENS", "BatchCore", "CoreSettings"]

log = logging.getLogger("dflash.batch")

POOL_BLOCK_TOKENS = 16
_FIRST_ROW = slice(0, 1)


class BatchCore(PromptSteps, DeviceRoundSteps, PlainAheadSteps):
    """The core's state and its steps: admission, the step's dispatch, host-built rounds and their commits, and the
    end of sequences; prompt steps, device rounds and plain steps launched ahead in their own modules."""

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
        self.pause = SpeculationPause()  # speculation off for a while where it stopped paying under load
        self.tree_budgets = TreeBudgetChooser()  # steps of device-round DDTree requests only (`_tree_option`)
        self.chain_lengths = TreeBudgetChooser()  # steps of linear requests on the device, by chain length
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
        # DDTree steps (and linear steps) with their trees built on the device (`dflash.batch.device_trees`)
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
        self._first_tokens: list[FirstToken] | None = None
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
            if seq.speculative and self.pause.holds(self._step_index, len(self.active)):
                seq.stop_speculating()  # speculation is paused under this load: the request starts plain
                self.pause.paused_requests += 1
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
        # request bucket -> tree budgets (`chains`: the chain lengths of linear requests, the engine's default
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
            if self.overlap is not None:
                self.graphs.ensure_choices(requests)
        drafter = self.drafter_graphs.graphs.captured if self.drafter_graphs is not None else 0
        trees = self.device_trees.captured if self.device_trees is not None else 0
        return self.graphs.captured + self.graphs.choices.captured + drafter + trees

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
                stepped = self._overlapped_step(plain)
                self._step_kind = "prefill" if self._step_prefilled else "plain_ahead"
                return stepped
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
                    r.greedy = plain_greedy(r.seq.chooser, r.seq.produced)
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

    # ---- decoding rounds ---------------------------------------------------------------------------------
    def _plan_rounds(self, decoders: list[Sequence]) -> list[Round]:
        speculating = sum(1 for s in decoders if s.speculative)
        if speculating and any(s.paused for s in decoders):
            # requests that speculate beside ones paused under load (they arrived after the pause): plain steps for
            # everyone until the paused ones end (a batch of mixed kinds takes the host-built path), features kept;
            # not counted towards another pause: the chooser decides once the batch speculates as one
            self._count_plain_step(decoders, 0)
            return [Round(seq, "plain") for seq in decoders]
        plan = self.policy.share(speculating, plain_rows=len(decoders) - speculating)
        kind = self._device_kind(decoders) if len(decoders) > 1 else None
        if kind is not None:
            option = self._tree_option(decoders, chain=kind == "chain")  # 0: a plain step
            self._count_plain_step(decoders, speculating if option == 0 and self._rounds_lose() else 0)
            if option == 0:
                return [Round(seq, "plain") for seq in decoders]
            if kind == "chain":  # chains of `option` drafts (on the device where the step fits it)
                return [Round(seq, "linear", outputs=option) for seq in decoders]
            rounds = [self._round_for(seq, RoundPlan(option, plan.linear_drafts)) for seq in decoders]
            if any(r.kind != "tree" for r in rounds):  # a request with one token left: a device round serves it too
                drafts = min(self.device_trees.block - 1, option) if self.device_trees is not None else 0
                whole = [Round(seq, "tree", outputs=drafts, budget=option) for seq in decoders]
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
            rounds = [Round(r.seq, "plain") for r in rounds]
        if len(decoders) > 1:
            self._count_plain_step(decoders, 0)  # no measured comparison on this path: it never pauses
        return rounds

    def _round_gain(self) -> float | None:
        """The best round's predicted speed over a plain step's, as the chooser that decided this step last
        predicted it (None: no such prediction)."""
        if self._step_choice is None:
            return None
        chooser, bucket, _ = self._step_choice
        return chooser.round_gain(bucket)

    def _rounds_lose(self) -> bool:
        """Whether this step's chooser last predicted its best round clearly slower than a plain step
        (`dflash.batch.speculation_pause.PAUSE_BELOW`)."""
        gain = self._round_gain()
        return gain is not None and gain < PAUSE_BELOW

    def _count_plain_step(self, decoders: list[Sequence], speculating: int) -> None:
        """A step whose `speculating` speculative requests all take plain steps (0: some speculates): after a run of
        them under load, those requests stop speculating (`dflash.batch.speculation_pause`). Not while a device
        round is in flight: its requests' state is the device's until it is read (the step plans again then)."""
        if speculating and self.device_trees is not None and self.device_trees.launched is not None:
            return
        if not self.pause.due(self._step_index, speculating, speculating > 0):
            return
        for seq in decoders:
            if seq.speculative:
                seq.stop_speculating()
                self.pause.paused_requests += 1
        gain = self._round_gain()
        self.pause.gains.append(gain)
        log.info("speculation paused under load: %d requests decode plainly (best round predicted at %s x a plain "
                 "step)", speculating, "?" if gain is None else f"{gain:.2f}")

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

    def _round_for(self, seq: Sequence, plan: RoundPlan) -> Round:
        block = self.drafter.config.block_size if self.drafter is not None else 1
        if seq.mode == "linear" and plan.linear_drafts > 0:
            return Round(seq, "linear", outputs=plan.linear_drafts)
        if seq.mode == "ddtree" and plan.ddtree_budget > 0 and block > 1:
            max_depth = min(block - 1, seq.request.max_new_tokens - seq.produced - 1)
            if max_depth > 0:
                return Round(seq, "tree", outputs=min(block - 1, plan.ddtree_budget), budget=plan.ddtree_budget)
        return Round(seq, "plain")

    def _draft(self, rounds: list[Round]) -> None:
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
        candidates = tree_candidates(trees)
        chains = greedy_drafts([(r, score) for r, score in zip(drafting, scores, strict=True) if r.kind == "linear"])
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

    def _select(self, drafting: list[Round], lattices: list[CandidateLattice]) -> None:
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

    def _decoding_rows(self, rounds: list[Round]) -> list[TargetRows]:
        """Every round's target rows; plain rounds' tokens and positions as views of two tensors built at once."""
        device = torch.device("cpu") if self.graphs is not None else self.target_pool.device  # graphs load from host
        plain = [r for r in rounds if r.kind == "plain"]
        if plain:
            tokens = long_tensor([r.seq.pending for r in plain], device)  # [plain]
            positions = long_tensor([r.seq.start for r in plain], device)  # [plain]
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

    def _round_rows(self, r: Round, device: torch.device) -> TargetRows:
        """A linear round's block or a tree round's nodes (plain rounds: `_decoding_rows`)."""
        seq = r.seq
        assert seq.target is not None
        if r.kind == "linear":
            assert r.drafts is not None
            count = len(r.drafts) + 1
            tokens = long_tensor([seq.pending, *r.drafts], device)
            positions = long_tensor(range(seq.start, seq.start + count), device)
            r.rows = TargetRows(seq.target, tokens, positions, logit_rows=slice(0, count))
            return r.rows
        tree = r.tree if r.tree is not None else linear_chain_tree([])
        r.tree = tree
        tokens, positions, visibility = tree_verify_inputs(tree, seq.pending, seq.start, 0, device=device)
        chain = tree.max_depth == tree.num_nodes  # the ancestor mask is the causal one
        r.rows = TargetRows(seq.target, tokens, positions, None if chain else visibility,
                            logit_rows=slice(0, tree.num_nodes + 1))
        return r.rows

    def _choices(self, rounds: list[Round], out: TargetOutput, first: int) -> list[list[int] | None]:
        """Every round's choices at its logit rows, on the host (None: its sequence failed choosing and ended).

        A plain greedy round takes the pass's host argmax; every other round is chosen on the logits' device (by
        its chooser: constraints, penalties, EOS suppression, the same operations as alone; sampled plain rows that
        only their logits decide, all in one program: `drawn_plain`) and all of them are read back in one
        transfer, so that a request choosing on the device costs the step no synchronisation of its own. Rounds are
        numbered from `first` in the pass's outputs."""
        choices: list[list[int] | None] = [None] * len(rounds)
        chosen: list[tuple[int, torch.Tensor]] = []  # (round number, its choices [rows] on the logits' device)
        drawn = [number for number, r in enumerate(rounds) if drawn_plain(r)]
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
            if drawn_plain(r):
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

    def _choose(self, r: Round, logits: torch.Tensor) -> torch.Tensor:
        """A round's choices by its chooser: logits [rows, vocab] -> tokens [rows], left on their device."""
        seq = r.seq
        if r.kind == "plain":
            return seq.chooser.choose(logits, seq.produced)  # [1]
        # a sampled round's rows as a device round samples them, with the same uniforms: the same tokens either way
        drawn = not seq.chooser.params.greedy and choice_stateless(seq.chooser, seq.produced)
        if r.kind == "linear":
            assert r.drafts is not None
            if drawn:
                positions = list(range(seq.start, seq.start + len(r.drafts) + 1))
                return sample_tree_rows(logits, seq.chooser.params, seq.row_seed(), positions)  # [k+1]
            allowed = seq.chooser.allowed(r.drafts) if seq.chooser.constrained else None
            return seq.chooser.choose(logits, seq.produced, allowed)  # [k+1]
        assert r.tree is not None
        if drawn:
            depths = r.tree.host.depths if r.tree.host is not None else r.tree.depths.tolist()
            positions = [seq.start, *(seq.start + d for d in depths)]
            return sample_tree_rows(logits, seq.chooser.params, seq.row_seed(), positions)  # [n+1]
        return tree_choices(seq.chooser, logits, r.tree, seq.produced)  # [n+1]

    def _after_round(self, r: Round, out: TargetOutput, index: int, choices: list[int]) -> None:
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
            accepted = matching_prefix(r.drafts, choices)
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


