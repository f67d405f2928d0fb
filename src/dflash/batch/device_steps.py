"""Device rounds in the batched core (`dflash.batch.device_trees`): where every decoding request is a DDTree request
or a linear one (a chain), greedy or sampled, a step is one round built on the device; the tree budget or chain
length is chosen from measured step times (`dflash.batch.tree_budgets`), and a round is launched before the one
before it is read, the prompt chunks due running in a pass of their own beside it."""

from __future__ import annotations

import logging

from dflash.batch.core_parts import CoreParts
from dflash.batch.device_trees import LaunchedRound, RoundResult
from dflash.batch.padded import PaddedShape
from dflash.batch.rounds import FirstToken, Round, device_choice, device_round
from dflash.batch.sequence import Sequence
from dflash.batch.tree_budgets import TreeBudgetChooser, candidate_budgets, candidate_chains
from dflash.drafter.model import DFlashDrafter

log = logging.getLogger("dflash.batch")


class DeviceRoundSteps:
    # the option chosen for this step's decoders, and (chooser, request bucket, option) to measure: `_tree_option`
    _option_memo: tuple[tuple[int, tuple[int, ...]], int] | None
    _step_choice: tuple[TreeBudgetChooser, int, int] | None
    _step_prefilled: bool
    _first_tokens: list[FirstToken] | None
    last_batch: int

    def _budgets_for(self: CoreParts, decoding: int, chain: bool = False) -> list[int]:
        """The tree budgets (`chain`: the chain lengths) a step of `decoding` DDTree (linear) requests may take
        (alone: the configured one); the same for every count of one request bucket (the bucket's row share), so
        that each bucket measures a few."""
        block = self.drafter.config.block_size if self.drafter is not None else 1
        bucket = 1 if decoding == 1 else PaddedShape.bucket_requests(decoding, self.settings.max_batch)
        share = self.policy.share(bucket, plain_rows=0)
        top = min(share.linear_drafts, block - 1) if chain else share.ddtree_budget
        if decoding == 1:
            return [top] if top > 0 else []
        return candidate_chains(top) if chain else candidate_budgets(top)

    def _device_kind(self: CoreParts, decoders: list[Sequence]) -> str | None:
        """"tree" where every decoding request is a DDTree request the device trees serve (greedy, or sampled with
        nothing but its logits and seed deciding: `device_choice`), "chain" where every one is such a linear request
        (served as one-path trees), else None."""
        if self.device_trees is None or not decoders:
            return None
        mode = decoders[0].mode
        if mode not in ("ddtree", "linear") or not all(
            s.mode == mode and s.feature_rows is not None and device_choice(s) for s in decoders
        ):
            return None
        return "tree" if mode == "ddtree" else "chain"

    def _tree_option(self: CoreParts, decoders: list[Sequence], chain: bool = False) -> int:
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

    def _device_tree_step_fits(self: CoreParts, rounds: list[Round], *, ahead: bool = False) -> bool:
        """Whether this step's rounds go through the device trees: every one a tree round of one budget (greedy or
        sampled on the device), or every one a linear round of one draft count (a chain), each request's
        round writing only positions it reserved (`ahead`: the round starts after the unread one, up to depth + 1
        positions later). A round may draft past a request's last token: its sink keeps only what the request
        asked for."""
        trees = self.device_trees
        found = device_round(rounds)
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
            if seq.feature_rows is None or not device_choice(seq):
                return False
            if seq.start + reach >= self.positions_needed(seq):
                return False
        return True

    def _device_tree_step(self: CoreParts, rounds: list[Round]) -> int:
        """Launch this step's round from the committed state; it is read at the next step."""
        assert self.device_trees is not None
        found = device_round(rounds)
        assert found is not None
        self.device_trees.launch([r.seq for r in rounds], found[0], chain=found[1])
        self.last_batch = len(rounds)
        return len(rounds)

    def _follow_device_round(self: CoreParts) -> int | None:
        """Where the unread device round's requests (less those that ended) are this step's decoding ones, with
        perhaps some that began decoding since (joining in ended requests' slots or the bucket's free ones), and go
        on with the same shape: run any prompt chunk due in a pass of its own (a request in its prompt does not
        break the chain), launch their next round from the state the unread one leaves on the device (a joining
        request's inputs loaded from the host), then read and commit that one (the host's work overlaps the GPU's),
        and last read the first token of each prompt that ended. Otherwise read and commit it, and return None: the
        step goes on from the committed state."""
        trees = self.device_trees
        assert trees is not None and trees.launched is not None
        launched = trees.launched.seqs  # in the launched round's order, requests that ended since included
        live = [s for s in launched if s.phase != "done"]
        rounds: list[Round] = []
        decoding = [s for s in self.active if s.phase == "decode"]
        in_round = {id(s) for s in live}
        staying = [s for s in decoding if id(s) in in_round]
        joiners = [s for s in decoding if id(s) not in in_round]
        placed = _placed(launched, joiners, trees.launched.shape.requests, self.drafter)
        seqs, joined = placed if placed is not None else (launched, [])
        same = (
            live and placed is not None and len(staying) == len(live)
            and all(a is b for a, b in zip(staying, live, strict=True))
        )
        # ended requests' slots ride as padding while the decoding requests, with those in their prompts (which join
        # next), still fill the request bucket; more requests than it holds join only where slots are free
        bucket = trees.launched.shape.requests
        least = PaddedShape.bucket_requests(len(decoding), self.settings.max_batch)
        if same and least <= bucket <= PaddedShape.bucket_requests(len(self.active), self.settings.max_batch):
            rounds = self._plan_rounds(decoding)
        found = device_round(rounds)
        size, chain = found if found is not None else (0, False)
        if not (self._device_tree_step_fits(rounds, ahead=True) and trees.can_follow(seqs, size, chain, joined)):
            unread = trees.take()
            assert unread is not None
            self._commit_device_round(unread)
            return None
        # prompt chunks due go first: the host reads their first tokens after launching the next round and
        # committing the last, so it does not wait for the next round to run
        with self._prompts_beside_launch() as prefills:
            try:
                # an ended request's slot rides as padding until the requests change (no chain break at its end)
                ended = [index for index, seq in enumerate(seqs) if seq.phase == "done"]
                previous = trees.launch(seqs, size, chain=chain, follow=True, ended=ended, joined=joined)
            except Exception as exc:  # the launch failed: its requests end with the error (the unread round too)
                log.exception("batched step failed")
                trees.take()
                for seq in seqs:
                    self._end(seq, exc)
                return len(seqs) + len(prefills)
            assert previous is not None
            self._commit_device_round(previous)
        self.last_batch = len(seqs) + len(prefills)
        return self.last_batch

    def _commit_device_round(self: CoreParts, launched: LaunchedRound) -> None:
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

    def _after_device_round(self: CoreParts, seq: Sequence, budget: int, result: RoundResult, chain: bool = False) -> None:
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


def _placed(
    launched: list[Sequence], joiners: list[Sequence], requests: int, drafter: DFlashDrafter | None
) -> tuple[list[Sequence], list[int]] | None:
    """The launched round's requests with `joiners` in ended requests' slots, then in the bucket's free ones (of
    `requests`): (the next round's requests, the joiners' slots); None where they do not fit or one's new drafter
    context exceeds a block (a joiner's drafter context but the last block is written as its prompt ends)."""
    block = drafter.config.block_size if drafter is not None else 1
    for seq in joiners:
        features = seq.new_features
        if features is None or features.shape[0] > block:
            return None
    free = [index for index, seq in enumerate(launched) if seq.phase == "done"]
    free += range(len(launched), requests)
    if len(joiners) > len(free):
        return None
    placed = list(launched)
    for seq, slot in zip(joiners, free, strict=False):
        if slot < len(placed):
            placed[slot] = seq
        else:  # the free slots after the last are taken in order
            placed.append(seq)
    return placed, free[: len(joiners)]
