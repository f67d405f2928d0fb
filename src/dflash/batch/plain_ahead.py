"""Plain steps launched one ahead of reading their tokens in the batched core (`dflash.batch.overlap`): where every
decoding request takes a plain step that its logits and seed alone decide. Prompt chunks due run in a pass of their
own launched beside the step, and a request whose prompt ended joins the next launch."""

from __future__ import annotations

import logging
import time

from dflash.batch.core_parts import CoreParts
from dflash.batch.overlap import Launched
from dflash.batch.rounds import Round, choice_stateless
from dflash.batch.sequence import Sequence
from dflash.batch.step_choice import StepSampling

log = logging.getLogger("dflash.batch")


class PlainAheadSteps:
    last_batch: int
    # the last launched step's requests, in order, and their sampling (`_sampling_for`)
    _step_sampling: tuple[tuple[Sequence, ...], StepSampling | None] | None = None

    def _overlapped_rounds(self: CoreParts) -> list[Round] | None:
        """This step's rounds when it can be launched ahead: every decoding request (the others are in their
        prompts) taking a plain step whose choice depends on nothing chosen before (`choice_stateless`); None
        otherwise."""
        assert self.overlap is not None
        decoders = [s for s in self.active if s.phase == "decode"]
        if not decoders:
            return None
        rounds = self._plan_rounds(decoders)
        for r in rounds:
            if r.kind != "plain" or not choice_stateless(r.seq.chooser, self.overlap.produced(r.seq)):
                return None
        return rounds

    def _overlapped_step(self: CoreParts, rounds: list[Round]) -> int:
        """Launch the prompt chunks due (their first tokens copied back without a wait), then this step's plain rows,
        then read and commit the step launched before it, and last read the prompts' first tokens: the host reads
        nothing the GPU has not reached before the plain step it just queued."""
        assert self.overlap is not None
        with self._prompts_beside_launch() as prefills:
            self._launch_plain(rounds)
        self.last_batch = len(rounds) + len(prefills)
        return self.last_batch

    def _launch_plain(self: CoreParts, rounds: list[Round]) -> None:
        assert self.overlap is not None
        now = time.perf_counter()
        # a request whose in-flight token is its last allowed one gets no further row
        launch = [r for r in rounds if self.overlap.produced(r.seq) < r.seq.request.max_new_tokens]
        previous = self.overlap.launched
        if launch:
            seqs = [r.seq for r in launch]
            try:
                previous = self.overlap.launch(
                    seqs, self._decoding_rows(launch), now, self._sampling_for(seqs),
                    beside_prompts=self._step_prefilled,
                )
            except Exception as exc:  # the launch failed: its requests and the unread step's end with the error
                log.exception("batched step failed")
                unread = self.overlap.take()
                for seq in {id(s): s for s in [*seqs, *(unread.seqs if unread else [])]}.values():
                    self._end(seq, exc)
                return
            for seq in seqs:  # a plain row is kept whatever its token: the position advances now
                assert seq.target is not None
                seq.target.crop(seq.start + 1)
                seq.start += 1
        else:
            self.overlap.take()
        if previous is not None:
            if launch and not self._last_step_captured and not previous.beside_prompts:
                # consecutive launches: the time between them (the last step) is what a plain step costs here
                self.policy.costs.observe(len(previous.seqs), False, now - previous.launched_at)
            self._commit_launched(previous)

    def _sampling_for(self: CoreParts, seqs: list[Sequence]) -> StepSampling | None:
        """How the launched step chooses its requests' tokens: None where all of them take the plain argmax; else
        their sampling, every request drawn at once on the device: the argmax for greedy ones, for sampled ones the
        draw of (its seed, its row's position) that the synchronous step makes (`dflash.batch.step_choice`). Every
        request here chooses from its logits alone (the overlap's condition). The same requests in the same order
        get the same object back, so the draw's parameters are sent once for a run of such steps."""
        cached = self._step_sampling
        # held, not their id()s: a new request could take an ended one's id
        if cached is not None and len(cached[0]) == len(seqs) and all(a is b for a, b in zip(cached[0], seqs, strict=True)):
            return cached[1]
        sampling = None
        if not all(s.chooser.params.greedy for s in seqs):
            sampling = StepSampling([s.chooser.params for s in seqs], [s.row_seed() for s in seqs])
        self._step_sampling = (tuple(seqs), sampling)
        return sampling

    def _read_launched(self: CoreParts) -> None:
        self._step_sampling = None  # the run of launched steps ends: its requests are not held any longer
        launched = self.overlap.take() if self.overlap is not None else None
        if launched is not None:
            self._commit_launched(launched)

    def _commit_launched(self: CoreParts, launched: Launched) -> None:
        """Read a launched step's tokens and commit them (a request that ended since is skipped: its row is
        discarded)."""
        try:
            tokens = launched.tokens()
        except Exception as exc:
            log.exception("batched step failed")
            for seq in launched.seqs:
                self._end(seq, exc)
            return
        # every request's row [1, F] as views made in one call (indexing per request costs more host time)
        rows = launched.features.source[: len(tokens), :1].unbind(0) if launched.features is not None else None
        for index, (seq, token) in enumerate(zip(launched.seqs, tokens, strict=True)):
            if seq.phase == "done":
                continue
            if seq.mode == "ddtree":  # a root-only tree, counted as a round as the single-request loop does
                seq.stats.record_round(0, 0)
            features = rows[index] if seq.speculative and rows is not None else None
            self._guarded(seq, self._commit, seq, [token], features)
