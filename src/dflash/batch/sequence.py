"""One record per request in the batched core: what it asked for, where it stands, where its output goes.

A sequence moves through three phases: `waiting` (queued, owns no memory), `prefill` (its prompt goes through the
target chunk by chunk, interleaved with other requests' decoding), `decode` (one round per step: a plain step, a
linear verification or a DDTree tree) and ends `done`. The speculative state is the same as a single-request
generation's (`dflash.speculative.session.SpecState`): `start` is the position of `pending`, the committed token without
target K/V yet, and `new_features` are the features of the positions the drafter has not read.

A hybrid model's linear-attention layers add a per-request state beside the target table (`SlotTable.recurrent`),
with the same commit points: the table's `crop`/`compact` after each round is where that state keeps the
accepted rows (a chain's first rows, or a tree's path replayed).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from dflash.batch.device_sampling import device_seed
from dflash.batch.policy import PRIOR_ACCEPTANCE
from dflash.batch.pool import SlotTable
from dflash.generation.output import OutputSink
from dflash.generation.request import GenerationRequest, GenerationResult, GenerationStats
from dflash.generation.selection import TokenChooser


@dataclass
class Sequence:
    request: GenerationRequest
    mode: str  # "none" | "linear" | "ddtree"
    sink: OutputSink
    chooser: TokenChooser
    should_stop: Callable[[], bool] | None = None
    stats: GenerationStats = field(default_factory=GenerationStats)
    phase: str = "waiting"
    submitted_at: float = field(default_factory=time.perf_counter)
    target: SlotTable | None = None
    drafter: SlotTable | None = None
    prefilled: int = 0  # prompt positions with committed target K/V
    prompt_features: list[torch.Tensor] = field(default_factory=list)  # each [rows, n*hidden], in order
    start: int = 0
    pending: int = 0
    # the features of positions the drafter has not read, as the rows rounds kept, in order (each [rows, n*hidden]):
    # joined only when a round drafts (`new_features`), not once per plain step while speculation is off
    feature_rows: list[torch.Tensor] | None = None
    prefill_started: float = 0.0
    decode_started: float = 0.0
    drafted_rounds: int = 0  # verified rounds that had drafts, and the tokens they committed (the policy's input)
    drafted_tokens: int = 0
    # DDTree rounds by budget: budget -> [rounds, tokens committed], a round at budget B also counting what each
    # smaller candidate budget's tree would have committed (`dflash.batch.tree_budgets`)
    tree_rounds: dict[int, list[int]] = field(default_factory=dict)
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)
    resumed: int = 0  # output tokens at the end of the prompt: it began on the single-request path (`resume_from_output`)
    device_seed: int | None = None  # its rows' uniforms in sampled device rounds (`dflash.batch.device_sampling`)
    paused: bool = False  # a speculative request made plain under load (`dflash.batch.speculation_pause`)

    def row_seed(self) -> int:
        """The seed of its sampled rows' uniforms (drawn at first use: from its own seed where it gave one)."""
        if self.device_seed is None:
            self.device_seed = device_seed(self.chooser.params)
        return self.device_seed

    @property
    def prompt_length(self) -> int:
        return len(self.request.prompt_ids)

    @property
    def produced(self) -> int:
        return len(self.sink.token_ids)

    @property
    def new_features(self) -> torch.Tensor | None:
        """[rows, n*hidden]: the features of positions start - rows .. start - 1 (None before decoding)."""
        parts = self.feature_rows
        if parts is None:
            return None
        if len(parts) > 1:
            parts[:] = [torch.cat(parts)]
        return parts[0] if parts else None

    @new_features.setter
    def new_features(self, features: torch.Tensor | None) -> None:
        self.feature_rows = None if features is None else [features]

    def keep_features(self, rows: torch.Tensor) -> None:
        """Append the features of a round's kept positions (rows [n, n*hidden])."""
        if self.feature_rows is None:
            self.feature_rows = [rows]
        else:
            self.feature_rows.append(rows)

    @property
    def speculative(self) -> bool:
        return self.mode != "none"

    def stop_speculating(self) -> None:
        """Decode as a plain request from now on (`dflash.batch.speculation_pause`): the drafter's state goes (its
        context rows, its table's blocks). Its outputs stay what they were going to be: its plain steps choose as its
        rounds would."""
        self.mode = "none"
        self.paused = True
        self.feature_rows = None
        if self.drafter is not None:
            self.drafter.release()
            self.drafter = None

    def expected_tokens(self, prior: float = PRIOR_ACCEPTANCE) -> float:
        """Tokens a drafted round of this request commits, as measured so far (`prior` before a few rounds)."""
        if self.drafted_rounds < 3:
            return prior
        return self.drafted_tokens / self.drafted_rounds

    def record_drafted_round(self, drafted: int, accepted: int) -> None:
        """Count a verified round with drafts (root-only rounds count in the stats only, as before)."""
        self.stats.record_round(drafted, accepted)
        self.drafted_rounds += 1
        self.drafted_tokens += accepted + 1

    def record_tree_round(self, budget: int, tokens: int, within: dict[int, int]) -> None:
        for size, committed in ((budget, tokens), *within.items()):
            totals = self.tree_rounds.setdefault(size, [0, 0])
            totals[0] += 1
            totals[1] += committed

    def expected_tree_tokens(self, budget: int, prior: float) -> float:
        """Tokens a DDTree round at `budget` commits for this request, as measured (`prior` before 3 rounds)."""
        totals = self.tree_rounds.get(budget)
        if totals is None or totals[0] < 3:
            return prior
        return totals[1] / totals[0]

    def resume_from_output(self) -> None:
        """Continue in the batched core after a single-request run stopped early: the prompt extended by every token
        produced so far (computed again, the prefix cache serving the prompt's blocks), back to waiting."""
        self.resumed = self.produced
        self.request = replace(self.request, prompt_ids=[*self.request.prompt_ids, *self.sink.token_ids])
        self.phase = "waiting"

    def stop_requested(self) -> bool:
        return self.should_stop is not None and bool(self.should_stop())

    def release(self) -> None:
        """Give the pool blocks back (idempotent)."""
        for table in (self.target, self.drafter):
            if table is not None:
                table.release()

    def finish(self, error: BaseException | None = None) -> None:
        """End the sequence: record the timings, free its memory, wake the caller."""
        if self.done.is_set():
            return
        self.release()
        self.error = error
        if self.decode_started:
            self.stats.decode_s = time.perf_counter() - self.decode_started
        self.stats.completion_tokens = self.produced
        self.phase = "done"
        self.done.set()

    def result(self) -> GenerationResult:
        if self.error is not None:
            raise self.error
        assert self.sink.finish_reason is not None
        return GenerationResult(
            text=self.sink.text, token_ids=self.sink.token_ids, finish_reason=self.sink.finish_reason,
            stats=self.stats, stop_reason=self.sink.stop_reason,
        )
