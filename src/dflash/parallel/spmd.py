"""Driving a tensor-parallel engine: every rank runs the same decoding loop, the first rank decides for all.

The first rank (the leader) serves the requests. Before each generation it hands the request to the other ranks
(the followers) over the control group; then every rank calls `Engine.generate` with it, so every forward, and so
every collective inside it, happens on every rank in the same order. What only the leader can know is agreed
through small broadcasts at the points where the loops read it:

* each token choice (`RankAgreement.agree`, through `TokenChooser`): the leader chooses, the others take its tokens.
  Logits are identical on every rank anyway (the residual stream is summed by the same all-reduce), so greedy
  choices would agree by themselves; taking the leader's tokens also covers sampling and token constraints, which
  then exist on the leader alone (a constraint holds grammar state that is not sent to the followers);
* each `should_stop` poll (`RankAgreement.stop_rule`): the client's cancellation, seen by the leader, ends the
  generation at the same round boundary on every rank.

Everything else the loops decide (draft trees, acceptance, stop strings, EOS) follows from the tokens and from
computations that are the same on every rank. An error the leader meets while choosing is sent as token -1 and
raised on every rank, so no rank waits for a collective the others left. An error raised by the leader's
`on_text` callback becomes a cancellation (so the followers finish the generation with it) and is then re-raised.
Errors that strike one rank alone inside a forward (out of memory) are not recovered: the others then wait.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from dflash.engine.engine import Engine
from dflash.errors import DFlashError, GenerationError
from dflash.generation.request import GenerationRequest, GenerationResult, TokenCallback
from dflash.parallel.group import TensorParallel
from dflash.special_text import SpecialTextGuard

__all__ = ["Assignment", "LeaderEngine", "RankAgreement", "follow", "join_engine"]

log = logging.getLogger("dflash.parallel")


@dataclass(frozen=True)
class Assignment:
    """One generation handed to the followers (the request without its constraint, which the leader applies)."""

    request: GenerationRequest
    spec: str | None


class RankAgreement:
    """The broadcasts that keep the ranks of one engine in step (see the module docstring)."""

    def __init__(self, tensor_parallel: TensorParallel) -> None:
        self.tp = tensor_parallel
        self._flag = torch.zeros(1, dtype=torch.int32, device=tensor_parallel.device)

    # ---- within a generation (the compute group) ----------------------------------------------------------
    def agree(self, choose: Callable[[], torch.Tensor], rows: int, device: torch.device) -> torch.Tensor:
        """The leader's `choose()` -> tokens [rows] on every rank; followers do not run `choose`."""
        if self.tp.leader:
            try:
                tokens = choose().to(torch.long).contiguous()
            except BaseException:
                self._broadcast(torch.full((rows,), -1, dtype=torch.long, device=device))  # tells the others
                raise
            return self._broadcast(tokens)
        tokens = self._broadcast(torch.empty(rows, dtype=torch.long, device=device))
        if bool((tokens < 0).any()):
            raise GenerationError("the first tensor-parallel rank failed while choosing tokens")
        return tokens

    def stop_rule(self, should_stop: Callable[[], bool] | None) -> Callable[[], bool]:
        """A `should_stop` that every rank polls at the same points: the leader's answer (from `should_stop`)."""

        def agreed() -> bool:
            if self.tp.leader:
                self._flag.fill_(int(should_stop is not None and should_stop()))
            dist.broadcast(self._flag, src=0, group=self.tp.group)
            return bool(self._flag.item())

        return agreed

    def _broadcast(self, tokens: torch.Tensor) -> torch.Tensor:
        dist.broadcast(tokens, src=0, group=self.tp.group)
        return tokens

    # ---- between generations (the control group) ----------------------------------------------------------
    def hand_out(self, request: GenerationRequest, spec: str | None) -> None:
        """Leader: send the next generation to the followers."""
        self._send(Assignment(replace(request, constraint=None), spec))

    def finish(self) -> None:
        """Leader: tell the followers that no generation follows."""
        self._send(None)

    def next_assignment(self) -> Assignment | None:
        """Follower: wait for the leader's next generation (None: the run is over)."""
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=self.tp.control)
        message = box[0]
        if message is not None and not isinstance(message, Assignment):
            raise DFlashError(f"unexpected message from the first tensor-parallel rank: {type(message).__name__}")
        return message

    def _send(self, message: Assignment | None) -> None:
        dist.broadcast_object_list([message], src=0, group=self.tp.control)


def join_engine(engine: Engine, tensor_parallel: TensorParallel) -> RankAgreement:
    """Make `engine` (built on this rank's shard) choose tokens in agreement with the other ranks."""
    agreement = RankAgreement(tensor_parallel)
    engine.agreement = agreement
    return agreement


class LeaderEngine:
    """The leader's engine as the server and the command line see it: each generation is handed to the followers
    first. Other attributes are the engine's own (prefix cache, constraints, prompt helpers)."""

    def __init__(self, engine: Engine, agreement: RankAgreement) -> None:
        if not agreement.tp.leader:
            raise ValueError("only the first rank drives the others")
        self.engine = engine
        self.agreement = agreement
        self._lock = threading.Lock()  # one generation at a time: collectives must not interleave
        self._closed = False

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def max_ctx(self) -> int:
        return self.engine.max_ctx

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def options(self) -> Any:
        return self.engine.options

    def encode(self, text: str, guard: SpecialTextGuard | None = None) -> list[int]:
        return self.engine.encode(text, guard)

    def warm_up(self) -> int:
        """`Engine.warm_up` on every rank: the warm-up generation is handed out like any other, so each rank
        captures the same graphs, with their all-reduces, at the same point. Returns the forwards the leader's
        graph runner served (0 without graphs)."""
        from dflash.fastpath.dispatch import graph_runner_of

        runner = graph_runner_of(self.engine.target)
        if runner is None:
            return 0
        self.generate(self.engine.warm_up_request())
        return runner.served

    def generate(
        self,
        request: GenerationRequest,
        *,
        on_text: TokenCallback | None = None,
        should_stop: Callable[[], bool] | None = None,
        spec: str | None = None,
    ) -> GenerationResult:
        # refused requests never reach the followers
        self.engine.check_request(request)
        self.engine.spec_mode_for(request, spec)
        failure: list[BaseException] = []

        def guarded(text: str, ids: list[int]) -> None:
            if on_text is None or failure:
                return
            try:
                on_text(text, ids)
            except BaseException as exc:  # ended at the next round, on every rank, then raised
                failure.append(exc)

        def stop() -> bool:
            return bool(failure) or (should_stop is not None and should_stop())

        with self._lock:
            if self._closed:
                raise GenerationError("the tensor-parallel ranks have been shut down")
            self.agreement.hand_out(request, spec)
            result = self.engine.generate(
                request, on_text=guarded, should_stop=self.agreement.stop_rule(stop), spec=spec
            )
        if failure:
            raise failure[0]
        return result

    def close(self) -> None:
        """Release the followers (their loops return). Idempotent."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self.agreement.finish()

    def __getattr__(self, name: str) -> Any:
        if name in ("engine", "agreement"):  # not set yet (during construction or unpickling)
            raise AttributeError(name)
        return getattr(self.engine, name)


def follow(
    engine: Engine,
    agreement: RankAgreement,
    on_result: Callable[[GenerationResult | DFlashError], None] | None = None,
) -> int:
    """A follower's loop: run every generation the leader hands out, until it finishes. Returns how many ran.

    A `DFlashError` (a request refused, a generation failing on every rank alike) is logged and passed to
    `on_result`; the leader meets the same error at the same point and reports it to its client."""
    count = 0
    while (assignment := agreement.next_assignment()) is not None:
        outcome: GenerationResult | DFlashError
        try:
            outcome = engine.generate(assignment.request, should_stop=agreement.stop_rule(None), spec=assignment.spec)
        except DFlashError as exc:
            log.info("rank %d: generation ended with an error: %s", agreement.tp.rank, exc)
            outcome = exc
        count += 1
        if on_result is not None:
            on_result(outcome)
    return count
