"""CUDA graphs of the batched decoding step, one per padded shape (`dflash.batch.padded`): the target pass over the
decoding rows, and the drafter's block pass.

The engine chooses graphs (the models know nothing of them): the core hands its rows here on a CUDA device. A
shape's graph is captured on first use (or ahead of traffic, `ensure`), replayed afterwards; its input buffers are
refilled before each replay. All graphs share one memory pool, and the K/V pools they write are the engine's
(fixed addresses). Built with `graphed=False`, the same buffers are loaded and the same passes run eagerly, on any
device: the CUDA path's host work, tested and measured on the CPU.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dflash.batch.context_store import ContextStores
from dflash.batch.device_sampling import SAMPLED_MODES
from dflash.batch.padded import (
    MIN_KEY_BUCKET,
    ROW_BUCKETS,
    PaddedBatch,
    PaddedShape,
    PlacedTokens,
    padded_forward,
)
from dflash.batch.pool import BlockPool
from dflash.batch.step_choice import StepChoices, StepSampling
from dflash.batch.target_pass import RowViews, TargetOutput, TargetRows
from dflash.drafter.model import DFlashDrafter
from dflash.fastpath.capture import capture_graph
from dflash.fastpath.fused_drafter import fuse_drafter_weights, supports_fused_drafter
from dflash.kernels.triton_paged_attention import paged_attention_usable
from dflash.models.model import CausalLM

log = logging.getLogger("dflash.batch")

PaddedForward = Callable[[PaddedBatch], tuple[torch.Tensor, torch.Tensor | None]]
MAX_PREFILL_KEYS = 8192  # positions a prompt chunk may reach through the padded pass (masks [requests, rows, keys])
PREFILL_GRAPH_REQUESTS = 4  # prompt steps of more requests run eagerly (each shape met is captured)


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph | None  # None: the pass runs eagerly at each replay
    batch: PaddedBatch
    logits: torch.Tensor  # [requests, rows, vocab]
    features: torch.Tensor | None  # [requests, rows, F]


class PaddedGraphs:
    """Captured graphs of one padded forward, by shape."""

    def __init__(self, name: str, forward: PaddedForward, pool: BlockPool, window: int | None, max_requests: int,
                 memory: Any, *, graphed: bool = True, max_graphed_requests: int | None = None) -> None:
        """`max_graphed_requests`: shapes of more requests run eagerly (few steps meet them, and each shape met
        would be captured)."""
        self.name, self.forward, self.pool, self.window, self.max_requests = name, forward, pool, window, max_requests
        self._graphs: dict[PaddedShape, _Captured] = {}
        self._memory = memory
        self.graphed = graphed
        self.max_graphed_requests = max_graphed_requests

    @property
    def captured(self) -> int:
        return len(self._graphs)

    def ensure(self, shape: PaddedShape) -> _Captured:
        entry = self._graphs.get(shape)
        return entry if entry is not None else self._capture(shape)

    def replay(self, items: Sequence[TargetRows], placed: PlacedTokens | None = None) -> _Captured:
        """Load `items` and run their shape's pass. `placed`: first-row tokens on the device for some requests, in
        place of the loaded ones (tokens a launched step chose and the host has not read)."""
        entry = self.ensure(PaddedShape.of(items, self.max_requests))
        entry.batch.load(items)
        if placed is not None:
            placed.write(entry.batch.tokens)
        if entry.graph is not None:
            entry.graph.replay()
        else:
            entry.logits, entry.features = self.forward(entry.batch)
        return entry

    def _capture(self, shape: PaddedShape) -> _Captured:
        batch = PaddedBatch(shape, self.pool, self.window)  # all padding: nothing real is written
        eager = self.max_graphed_requests is not None and shape.requests > self.max_graphed_requests
        if not self.graphed or eager:
            entry = _Captured(None, batch, torch.empty(0), None)
            self._graphs[shape] = entry
            return entry
        graph, (logits, features) = capture_graph(lambda: self.forward(batch), self._memory, warmups=2)
        entry = _Captured(graph, batch, logits, features)
        self._graphs[shape] = entry
        log.info("captured the batched %s pass for %s", self.name, shape)
        return entry


class GraphedTargetPasses:
    """The target pass over the decoding rows."""

    def __init__(
        self, model: CausalLM, pool: BlockPool, capture: Sequence[int], max_requests: int, *, fused: bool = True,
        memory: Any = None, graphed: bool = True,
    ) -> None:
        forward: Callable[..., tuple[torch.Tensor, torch.Tensor | None]] = padded_forward
        if fused and graphed:
            from dflash.batch.fused_padded import fused_padded_forward, supports_fused_layers

            if supports_fused_layers(model):
                forward = fused_padded_forward
        layers = tuple(capture)
        memory = memory if memory is not None or not graphed else torch.cuda.graph_pool_handle()
        self.graphs = PaddedGraphs(
            "target", lambda batch: forward(model, pool, batch, layers), pool, model.sliding_window, max_requests,
            memory, graphed=graphed,
        )
        # prompt chunks through the same padded pass: every request's chunk in one pass per layer, where the packed
        # pass attends request by request. A step with the chunks of up to `PREFILL_GRAPH_REQUESTS` requests (the
        # usual one: under load requests arrive one or two at a time, as others end) replays a graph captured when
        # its shape is first met (eagerly, launching a few hundred kernels from Python costs more than a few small
        # chunks' work: results/gpu_concurrency_h100_arrivals.json, DDTree's prompt steps at 32 clients); more
        # requests' chunks run eagerly. Their graphs keep a memory pool of their own: a step reads a chunk's logits
        # after the decoding rows' graph has run, which would reuse a shared pool's memory
        self.prefills = PaddedGraphs(
            "prefill", lambda batch: forward(model, pool, batch, layers, last_rows=True), pool, model.sliding_window,
            max_requests, torch.cuda.graph_pool_handle() if graphed else None, graphed=graphed,
            max_graphed_requests=PREFILL_GRAPH_REQUESTS,
        )
        # launched plain steps' draws, graphed after the pass whose logits they read (a pool of their own: their
        # tokens are read after later replays)
        self.choices = StepChoices(torch.cuda.graph_pool_handle() if graphed else None, graphed=graphed)

    @property
    def captured(self) -> int:
        return self.graphs.captured

    def ensure(self, shape: PaddedShape) -> None:
        self.graphs.ensure(shape)

    def ensure_choices(self, requests: int) -> None:
        """Capture the launched plain steps' draws of `requests` requests for every mode where some request samples
        (ahead of traffic: a capture in a step holds up every request of it)."""
        entry = self.graphs.ensure(PaddedShape(requests, 1, MIN_KEY_BUCKET))
        if entry.graph is None:  # eager passes: nothing is captured
            return
        logits = entry.logits[:, 0]  # [requests, vocab]
        for mode in SAMPLED_MODES:
            self.choices.ensure(requests, logits.shape[1], logits.dtype, logits.device, mode)

    def run(self, items: Sequence[TargetRows], *, argmax: bool = True) -> TargetOutput:
        """`argmax`: also give every logits row's argmax on the host (some request of the step chooses greedily)."""
        entry = self.graphs.replay(items)
        count = len(items)
        wanted = [item.logit_rows for item in items]
        best: list[list[int]] | None = None
        if argmax:  # [requests, rows]: one operation and one transfer for every greedy row of the step
            rows_best: list[list[int]] = entry.logits[:count].argmax(dim=-1).tolist()
            best = [row[rows] for row, rows in zip(rows_best, wanted, strict=True)]
        # copied once: kept rows outlive the next replay (they become drafter context)
        copied = entry.features[:count].clone() if entry.features is not None else None
        features = None
        if copied is not None:
            features = RowViews(copied, [slice(0, item.count) for item in items])
        return TargetOutput(RowViews(entry.logits, wanted), features, best)

    def prefill_fits(self, items: Sequence[TargetRows]) -> bool:
        """Whether these prompt chunks go through `prefill`: rows within the largest row bucket, keys within
        `MAX_PREFILL_KEYS` (beyond, the packed pass: a padded pass derives masks over every key of every row)."""
        return all(item.count <= ROW_BUCKETS[-1] and item.table.length + item.count <= MAX_PREFILL_KEYS
                   for item in items)

    def prefill(self, items: Sequence[TargetRows]) -> TargetOutput:
        """Prompt chunks (`prefill_fits`), each wanting at most its last row's logits: one padded pass."""
        entry = self.prefills.replay(items)
        wanted = [slice(0, 1) if item.logit_rows.stop > item.logit_rows.start else slice(0, 0) for item in items]
        features = None
        if entry.features is not None:  # kept by the requests: a graph's output is copied (its next replay rewrites it)
            kept = entry.features if entry.graph is None else entry.features[: len(items)].clone()
            features = RowViews(kept, [slice(0, item.count) for item in items])
        return TargetOutput(RowViews(entry.logits, wanted), features)

    def launch(
        self, items: Sequence[TargetRows], placed: PlacedTokens | None, sampling: StepSampling | None = None
    ) -> tuple[torch.Tensor, RowViews | None]:
        """One plain row per request, nothing read back (`dflash.batch.overlap`): -> (each request's token
        [requests] on the device: the argmax, or where `sampling` is given the draw of `StepChoices`; its row's
        features [1, F] per request or None)."""
        entry = self.graphs.replay(items, placed)
        count = len(items)
        if sampling is None:  # read before the next replay overwrites the logits
            best = entry.logits[:count, 0].argmax(dim=-1)  # [requests]: the argmax as `run`'s
        else:
            best = self.choices.choose(entry.logits[:, 0], entry.batch.positions[:, 0], sampling)[:count]
        copied = entry.features[:count, :1].clone() if entry.features is not None else None
        features = RowViews(copied, [slice(0, 1)] * count) if copied is not None else None
        return best, features


def padded_drafter_forward(
    drafter: DFlashDrafter, target: CausalLM, pool: BlockPool, batch: PaddedBatch
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The drafter's block pass over a loaded batch (each request's block after its context, non-causal inside
    the block) -> (draft logits [requests, block - 1, vocab] of positions start+1 .., None)."""
    from dflash.batch.padded import PaddedAttention

    dtype = drafter.fc.weight.dtype
    batch.derive()
    backend = PaddedAttention(pool, batch, drafter.sliding)
    cos, sin = drafter.rotary.cos_sin(batch.positions, dtype)  # [requests, 1, block, head_dim]
    x = target.embed(batch.tokens).to(dtype)  # [requests, block, hidden]
    layer: Any
    for index, layer in enumerate(drafter.layers):
        attention = layer.self_attn
        q, k, v = attention.block_qkv(layer.input_layernorm(x), cos, sin)
        x = x + attention.o_proj(backend.attend(index, q, k, v, attention.head_dim**-0.5))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return drafter.project(target, drafter.norm(x[:, 1:])), None


class GraphedDrafterPasses:
    """The drafter's block pass of every speculating request, and the writes of its context rows before it."""

    def __init__(self, drafter: DFlashDrafter, target: CausalLM, pool: BlockPool, max_requests: int,
                 memory: Any, *, graphed: bool = True, fused: bool = True) -> None:
        """`fused`: a drafter of DFlash's layers (not DFlash2's, whose blocks also convolve)."""
        window = drafter.config.sliding_window if any(drafter.sliding) else None
        # captured passes through the fused kernels where the drafter allows (`fused_padded_drafter_forward`)
        self.fused = (
            fuse_drafter_weights(drafter)
            if fused and graphed and supports_fused_drafter(drafter)
            and paged_attention_usable(pool.device, drafter.config.head_dim)
            else None
        )
        weights = self.fused

        def forward(batch: PaddedBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
            if weights is None:
                return padded_drafter_forward(drafter, target, pool, batch)
            from dflash.batch.fused_padded import fused_padded_drafter_forward

            return fused_padded_drafter_forward(drafter, target, pool, weights, batch), None

        self.graphs = PaddedGraphs("drafter", forward, pool, window, max_requests, memory, graphed=graphed)
        self.block = drafter.config.block_size
        self.context = ContextStores(drafter, pool, memory, graphed=graphed)  # context rows' keys and values

    def run(self, items: Sequence[TargetRows], outputs: Sequence[int]) -> list[torch.Tensor]:
        """items: each request's block rows (visibility all ones) -> draft logits [outputs, vocab] per request."""
        entry = self.graphs.replay(items)
        return [entry.logits[index, :count] for index, count in enumerate(outputs)]
