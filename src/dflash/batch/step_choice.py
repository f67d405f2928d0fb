"""The tokens of a launched plain step where some request samples: drawn on the device in one captured graph.

A launched plain step (`dflash.batch.overlap`) of sampled requests draws each request's token from its row's logits
by the uniform of (its seed, its row's position), every request at once (`device_sampling.choose_rows`). Run
eagerly that is some twenty small operations a step, plus the host's work of making the uniforms and copying them:
host time that the launched-ahead step exists to hide, and at a few dozen requests a step of a small model it is
what the step waits for. Here the draw is captured once per (request count, choice mode) as a graph that reads the
target pass's logits and the positions already in its padded batch, makes the uniforms on the device
(`row_uniforms`, equal to the host's) and writes the tokens to a buffer of its own: a step sends one small table of
parameters and replays one graph. The draws are the ones `choose_step_rows` makes (the same function, the same
uniforms), graphed or not.

A graph serves every target shape of its request count: it reads copies of the logits and positions in buffers of
its own (a copy of a few megabytes on the device), so requests joining and leaving a run of launched steps, as key
lengths grow, meet a handful of graphs, each captured once, and not one per padded shape.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy
import torch

from dflash.batch.device_sampling import (
    PARAMETERS,
    choice_mode,
    choose_rows,
    parameter_table,
    row_uniforms,
    table_sampling,
)
from dflash.fastpath.capture import capture_graph
from dflash.generation.sampling import SamplingParams
from dflash.host_copies import to_device


@dataclass(frozen=True)
class StepSampling:
    """The sampling of a launched plain step's requests, in its rows' order."""

    params: Sequence[SamplingParams]
    seeds: Sequence[int]  # each request's row seed (`Sequence.row_seed`)


def draw_step(logits: torch.Tensor, table: torch.Tensor, positions: torch.Tensor, mode: str) -> torch.Tensor:
    """logits [requests, vocab], table [requests, PARAMETERS] float64 (`StepChoices.table_of`),
    positions [requests] long (each row's position) -> tokens [requests]: the argmax for greedy requests, else the
    draw of (seed, position)."""
    sampling = table_sampling(table)
    uniforms = row_uniforms(sampling.seed, positions[:, None])  # [requests, 1]
    greedy = logits.argmax(dim=-1)[:, None]  # [requests, 1]
    return choose_rows(logits[:, None], sampling, uniforms, mode, greedy)[:, 0]


@dataclass
class _Choice:
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor  # [requests, vocab], the graph's input: a copy of the target pass's
    positions: torch.Tensor  # [requests] long, the graph's input
    table: torch.Tensor  # [requests, PARAMETERS] float64 on the device, the graph's input
    tokens: torch.Tensor  # [requests] long, the graph's output
    loaded: StepSampling | None = None  # the sampling whose parameters `table` holds


class StepChoices:
    """Graphs of the draw, one per (requests, vocab, logits dtype, choice mode)."""

    def __init__(self, memory: Any, *, graphed: bool) -> None:
        self._memory = memory
        self.graphed = graphed
        self._choices: dict[tuple[int, int, torch.dtype, str], _Choice] = {}

    @staticmethod
    def table_of(sampling: StepSampling, requests: int) -> numpy.ndarray:
        """float64 [requests, PARAMETERS]: each request's parameters, rows past them greedy (temperature 0)."""
        table = numpy.zeros((requests, PARAMETERS), dtype=numpy.float64)
        table[:, 2] = 1.0  # top_p of the padding rows: no filter
        table[: len(sampling.params)] = parameter_table(sampling.params, sampling.seeds)
        return table

    @property
    def captured(self) -> int:
        return len(self._choices)

    def choose(self, logits: torch.Tensor, positions: torch.Tensor, sampling: StepSampling) -> torch.Tensor:
        """logits [requests, vocab] and positions [requests] long, on the device (copied into the graph's inputs; a
        padding request's row is drawn greedily and ignored) -> the tokens [requests] on the device, queued without
        a wait (rewritten by the next draw of the same request count and mode)."""
        mode = choice_mode(sampling.params)
        if not self.graphed:  # eager passes: each replay's logits are new tensors, nothing to capture
            table = torch.from_numpy(self.table_of(sampling, logits.shape[0]))
            return draw_step(logits, to_device(table, logits.device), positions, mode)
        choice = self.ensure(logits.shape[0], logits.shape[1], logits.dtype, logits.device, mode)
        choice.logits.copy_(logits)
        choice.positions.copy_(positions)
        if choice.loaded is not sampling:  # the same requests' steps in a row send their parameters once
            table = torch.from_numpy(self.table_of(sampling, logits.shape[0]))
            choice.table.copy_(table.pin_memory(), non_blocking=True)
            choice.loaded = sampling
        choice.graph.replay()
        return choice.tokens

    def ensure(self, requests: int, vocab: int, dtype: torch.dtype, device: torch.device, mode: str) -> _Choice:
        """The graph of this draw, captured on first use (or ahead of traffic)."""
        key = (requests, vocab, dtype, mode)
        choice = self._choices.get(key)
        if choice is None:
            choice = self._capture(requests, vocab, dtype, device, mode)
            self._choices[key] = choice
        return choice

    def _capture(self, requests: int, vocab: int, dtype: torch.dtype, device: torch.device, mode: str) -> _Choice:
        logits = torch.zeros((requests, vocab), dtype=dtype, device=device)
        positions = torch.zeros(requests, dtype=torch.long, device=device)
        table = torch.zeros((requests, PARAMETERS), dtype=torch.float64, device=device)
        table[:, 2] = 1.0
        graph, tokens = capture_graph(lambda: draw_step(logits, table, positions, mode), self._memory, warmups=2)
        return _Choice(graph, logits, positions, table, tokens)
