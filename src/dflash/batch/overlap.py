"""Plain steps launched one step ahead of reading their tokens: the host's work of a step hidden under the device's
work of the next.

When every decoding request of a step takes a plain step whose choice depends only on its logits and its seed
(greedy, or sampled without constraint, penalties or EOS suppression left; plain requests, and speculative
ones once the policy stops speculating under load), the next step's inputs need nothing from the host but each
request's token, and the device has just chosen it (the argmax, or for sampled requests the draw of their seeds
and rows' positions, every request in one program, as the synchronous step draws it). So the core launches step
N+1 with those tokens copied on the device, and only then reads step N's tokens (one transfer, already landed or
landing while N+1 runs) and does N's host work: commits, detokenisation, stop checks, callbacks. The device has N+1 queued while the host works, so
a step costs the larger of the two instead of their sum.

Requests whose prompts end join the chain: their first token is on the host, the launched ones' on the device (`_tokens_of`
merges them), and the prompt chunks due run in a pass of their own launched beside the plain step
(`dflash.batch.plain_ahead`), so a request in its prompt breaks the chain neither while it prefills nor when it joins.

A plain step's K/V row is kept whatever its token, so a request's position and table advance at launch; only its
token, output and stop come one step late. A request that stops at step N (EOS, a stop string, cancellation) has one
more row computed in N+1, written to its own reserved positions (admission reserves a round past the output) and
discarded; blocks released meanwhile are written by later work only after N+1 in the stream's order. A request is
not launched again once its in-flight token is its last allowed one. Outputs equal the synchronous step's: the same
graph, the same choices.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from dflash.batch.padded import PlacedTokens
from dflash.batch.sequence import Sequence
from dflash.batch.target_pass import RowViews, TargetRows
from dflash.host_copies import to_device

if TYPE_CHECKING:
    from dflash.batch.graphs import GraphedTargetPasses
    from dflash.batch.step_choice import StepSampling


@dataclass
class Launched:
    """A plain step whose tokens are still on the device."""

    seqs: list[Sequence]
    best: torch.Tensor  # [requests] int64 on the device: each request's chosen token
    host: torch.Tensor  # [requests] int64 on the host (pinned on CUDA), filled by an asynchronous copy of `best`
    ready: torch.cuda.Event | None  # recorded after that copy (None: the copy was synchronous)
    features: RowViews | None  # per request [1, F] on the device: the row's captured features
    launched_at: float
    ids: frozenset[int] = frozenset()  # id() of each sequence in it
    beside_prompts: bool = False  # launched in a step that ran prompt chunks (its time is no plain step's cost)

    def tokens(self) -> list[int]:
        """Each request's token (waits for the copy)."""
        if self.ready is not None:
            self.ready.synchronize()
        values: list[int] = self.host.tolist()
        return values


class OverlappedSteps:
    """Launches plain steps through the target's padded graphs and keeps the last one until it is read."""

    def __init__(self, graphs: GraphedTargetPasses, max_batch: int, device: torch.device) -> None:
        self.graphs = graphs
        self.cuda = device.type == "cuda"
        # two host buffers in turn: a launch writes one while the previous launch's copy may still target the other
        self._host = [torch.zeros(max_batch, dtype=torch.long, pin_memory=self.cuda) for _ in range(2)]
        self._turn = 0
        self.launched: Launched | None = None

    def produced(self, seq: Sequence) -> int:
        """The tokens `seq` will have once the launched step is read: its output so far, plus one if it is in it."""
        return seq.produced + (self.launched is not None and id(seq) in self.launched.ids)

    def launch(
        self, seqs: list[Sequence], items: list[TargetRows], now: float, sampling: StepSampling | None = None,
        *, beside_prompts: bool = False,
    ) -> Launched | None:
        """Launch one plain row per request of `seqs` (`items`: their rows, tokens from the host, replaced on the
        device by the launched step's where it chose them). `sampling`: the requests' sampling, where some request
        samples (None: every request takes the argmax). Returns the previously launched step, for the caller to
        read and commit."""
        previous = self.launched
        placed = _tokens_of(previous, seqs) if previous is not None else None
        best, features = self.graphs.launch(items, placed, sampling)
        count = len(seqs)
        host = self._host[self._turn][:count]
        self._turn ^= 1
        ready = None
        if self.cuda:
            host.copy_(best, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        else:
            host.copy_(best)
        self.launched = Launched(seqs, best, host, ready, features, now, frozenset(map(id, seqs)), beside_prompts)
        return previous

    def take(self) -> Launched | None:
        """The launched step, now the caller's to read (nothing stays launched)."""
        launched, self.launched = self.launched, None
        return launched


def _tokens_of(previous: Launched, seqs: list[Sequence]) -> PlacedTokens | None:
    """The launched step's tokens of those of `seqs` in it, on the device, and their rows in `seqs` (the others'
    tokens, requests that joined since, are on the host in their rows already); None where none of them is in it."""
    index = {id(s): i for i, s in enumerate(previous.seqs)}
    rows = [row for row, s in enumerate(seqs) if id(s) in index]
    if not rows:
        return None
    order = [index[id(seqs[row])] for row in rows]
    if order == rows == list(range(len(rows))):  # the usual step: the same requests in the same order
        return PlacedTokens(previous.best[: len(rows)], None)
    # through pinned memory: a copy from pageable memory would wait for the launched step to run
    device = previous.best.device
    taken = previous.best[to_device(torch.tensor(order, dtype=torch.long), device)]
    return PlacedTokens(taken, to_device(torch.tensor(rows, dtype=torch.long), device))
