"""CUDA graphs of the batched decoding step's target pass, one per padded shape (`dflash.batch.padded`).

The engine chooses graphs (the model knows nothing of them): the core hands its decoding rows here on a CUDA
device. A shape's graph is captured on first use, replayed afterwards; its input buffers are refilled before each
replay. All graphs share one memory pool, and the K/V pool they write is the engine's (fixed addresses).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dflash.batch.padded import PaddedBatch, PaddedShape, padded_forward
from dflash.batch.pool import BlockPool
from dflash.batch.target_pass import TargetOutput, TargetRows
from dflash.models.model import CausalLM

log = logging.getLogger("dflash.batch")


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    batch: PaddedBatch
    logits: torch.Tensor  # [requests, rows, vocab]
    features: torch.Tensor | None  # [requests, rows, F]


class GraphedTargetPasses:
    def __init__(
        self, model: CausalLM, pool: BlockPool, capture: Sequence[int], max_requests: int, *, fused: bool = True
    ) -> None:
        self.model, self.pool, self.capture, self.max_requests = model, pool, tuple(capture), max_requests
        self._graphs: dict[PaddedShape, _Captured] = {}
        self._memory = torch.cuda.graph_pool_handle()
        self.forward = padded_forward
        if fused:
            from dflash.batch.fused_padded import fused_padded_forward, supports_fused_layers

            if supports_fused_layers(model):
                self.forward = fused_padded_forward

    @property
    def captured(self) -> int:
        return len(self._graphs)

    def ensure(self, shape: PaddedShape) -> None:
        if shape not in self._graphs:
            self._capture(shape)

    def run(self, items: Sequence[TargetRows]) -> TargetOutput:
        shape = PaddedShape.of(items, self.max_requests)
        entry = self._graphs.get(shape)
        if entry is None:
            entry = self._capture(shape)
        entry.batch.load(items)
        entry.graph.replay()
        best = entry.logits[: len(items)].argmax(dim=-1).cpu()  # [requests, rows]: one transfer for every greedy row
        logits, features, argmax = [], [], []
        for index, item in enumerate(items):
            logits.append(entry.logits[index, item.logit_rows])
            argmax.append(best[index, item.logit_rows])
            if entry.features is not None:  # copied: kept rows outlive the next replay (drafter context)
                features.append(entry.features[index, : int(item.tokens.numel())].clone())
        return TargetOutput(logits, features if entry.features is not None else None, argmax)

    def _capture(self, shape: PaddedShape) -> _Captured:
        batch = PaddedBatch(shape, self.pool, self.model.sliding_window)  # all padding: writes go to the trash slot
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up outside the graph (kernel selection, lazy initialisation)
                self.forward(self.model, self.pool, batch, self.capture)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._memory):
            logits, features = self.forward(self.model, self.pool, batch, self.capture)
        entry = _Captured(graph, batch, logits, features)
        self._graphs[shape] = entry
        log.info("captured the batched target pass for %s", shape)
        return entry
