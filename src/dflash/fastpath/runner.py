"""`GraphRunner`: the decode-time forwards of a target and its drafter as replayed CUDA graphs.

A graph bakes in the addresses of every tensor it touches, so the runner owns one persistent K/V storage per
model (sized for the whole context) and hands out caches that are views of it (`lease_*_cache`); a request whose
cache is such a view runs its decode steps, verifications, drafter rounds and prefill chunks (up to `max_rows`)
through graphs, anything else (a second live cache, an odd shape) falls back to the eager forward. Graphs are captured lazily per
shape: `rows` (the new tokens, padded to a power of two up to 8, then to a multiple of 8: at these sizes the
matrix products cost the same, they stream the weights; prefill chunks, which need no per-row logits, pad to a
power of two) and `bucket` (the cache slots attention reads, a power
of two >= the slots in use), so a replay does the work of the live context, not of the whole storage.

Per call the host copies the inputs into the graph's static buffers, replays it and returns copies of its
outputs; the cache length stays a host integer (acceptance is read back once per round anyway) and is written
into a one-element device tensor. With `capture=False` the same static forwards run eagerly, which is how the CPU
tests check the runner against the eager path.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from dflash.drafter.dflash2 import DFlash2Drafter
from dflash.drafter.model import DFlashDrafter, TargetHeads
from dflash.drafter.selector import SelectedChain
from dflash.errors import GenerationError
from dflash.fastpath.capture import capture_graph
from dflash.fastpath.dispatch import GraphForwards
from dflash.fastpath.fused_drafter import FusedDrafterWeights
from dflash.generation.forwards import register_forwards
from dflash.kernels.triton_delta_rule import delta_rule_program_serves
from dflash.kv.cache import KVCache
from dflash.kv.recurrent import ROLLBACK_MAX_ROWS
from dflash.kv.static_recurrent import StaticRecurrentStates
from dflash.models.model import CausalLM, ForwardOutput, LogitsMode

log = logging.getLogger("dflash.fastpath")

MIN_BUCKET = 256
MAX_GRAPH_ROWS = 128


def round_up_pow2(value: int, floor: int = 1) -> int:
    size = floor
    while size < value:
        size *= 2
    return size


def padded_rows(rows: int) -> int:
    """The graph shape serving `rows` new tokens: 1, 2, 4, 8, then multiples of 8."""
    return round_up_pow2(rows) if rows <= 8 else -(-rows // 8) * 8


@dataclass
class _Replay:
    """A captured (or, without CUDA graphs, directly called) static forward and its output tensors."""

    run: Callable[[], None]
    outputs: list[torch.Tensor] = field(default_factory=list)


@dataclass
class _RowInputs:
    """Static input buffers of the target graphs with `rows` new tokens."""

    input_ids: torch.Tensor  # [1, rows] long
    positions: torch.Tensor  # [1, rows] long
    tree_mask: torch.Tensor  # [rows, rows] bool
    causal: torch.Tensor  # [rows, rows] bool, lower triangle (a chain)
    identity: torch.Tensor  # [rows, rows] bool: padding rows see only themselves


class GraphRunner:
    def __init__(
        self,
        target: CausalLM,
        drafter: DFlashDrafter | None,
        capacity: int,
        *,
        capture: bool = True,
        max_rows: int = MAX_GRAPH_ROWS,
        fused: bool | None = None,
        draft_heads: TargetHeads | None = None,
    ) -> None:
        """`fused`: run the target's layers through the fused Triton kernels (None: on CUDA when supported).
        `draft_heads`: the target's embedding and LM head on the drafter's device when that is not the target's
        (`dflash.drafter.borrowed_heads`); the drafter's cache, inputs and graphs then live there."""
        from dflash.fastpath.fused_drafter import fuse_drafter_weights, supports_fused_drafter
        from dflash.fastpath.fused_hybrid import supports_fused_hybrid
        from dflash.fastpath.fused_layers import supports_fused_layers

        # held weakly: the runner is registered under its target (`dflash.generation.forwards`), whose entry goes
        # when the target does, which a strong reference from here would prevent
        self._target = weakref.ref(target)
        self.drafter = drafter
        self.draft_heads = draft_heads
        self.device = target.embed_tokens.weight.device
        self.draft_device = drafter.fc.weight.device if drafter is not None else self.device
        self.capture = capture and self.device.type == "cuda" and target.capturable
        fusable = supports_fused_layers(target) or supports_fused_hybrid(target)
        if fused is None:
            fused = self.device.type == "cuda" and fusable
        elif fused and not fusable:
            raise ValueError("this model's layers have no fused kernels (or Triton is missing)")
        self.fused = fused
        if fused and target.config.is_hybrid:
            from dflash.fastpath.fused_hybrid import join_all_projections

            join_all_projections(target)
        self.drafter_weights: FusedDrafterWeights | None = None
        if drafter is not None and fused and supports_fused_drafter(drafter):
            self.drafter_weights = fuse_drafter_weights(drafter)
        self.capacity = capacity
        self.hybrid = target.config.is_hybrid
        # a hybrid's forwards keep their rows for the rollback of its linear-attention state: at most so many
        self.max_rows = min(max_rows, ROLLBACK_MAX_ROWS) if self.hybrid else max_rows
        self.target_storage = target.new_cache(capacity)  # this rank's key/value heads under tensor parallelism
        self.live_rows = torch.zeros(1, dtype=torch.long, device=self.device)  # a hybrid graph's unpadded rows
        if self.hybrid:
            from dflash.models.gated_deltanet import new_recurrent_states

            self.target_storage.recurrent = new_recurrent_states(target.config, target.embed_tokens.weight, static=True)
        if fused:  # the fused forwards gather their rotary rows (positions stay below capacity + a graph's rows)
            target.rotary.prepare_table(capacity + 2 * max_rows, target.embed_tokens.weight.dtype, self.device)
            if drafter is not None and self.drafter_weights is not None:
                drafter.rotary.prepare_table(capacity + 2 * max_rows, drafter.fc.weight.dtype, self.draft_device)
        self.drafter_storage = drafter.new_cache(capacity) if drafter is not None else None
        self._leases: dict[str, weakref.ref[KVCache]] = {}
        self._replays: dict[tuple[object, ...], _Replay] = {}
        self._capture_streams: dict[torch.device, torch.cuda.Stream] = {}
        self.residents: dict[tuple[object, ...], Any] = {}  # `dflash.fastpath.resident` decoders
        self._rows: dict[int, _RowInputs] = {}
        self.length = torch.zeros(1, dtype=torch.long, device=self.device)  # committed slots, for the graphs
        self.pool = torch.cuda.graph_pool_handle() if self.capture else None
        # a graph's private memory comes from its own device's allocator: a drafter elsewhere gets a pool of its own
        self.draft_pool = self.pool if self.draft_device == self.device or not self.capture else (
            torch.cuda.graph_pool_handle()
        )
        self.captured = 0  # graphs captured so far
        self.served = 0  # forwards served by the static path (graph replays, or eager static calls)
        # prompt chunks longer than the graphs through the fused layers, eagerly (`_fused_chunk`): set for quantized
        # targets by `GraphForwards`, whose long chunks those are
        self.fuses_long_chunks = False
        self.fused_chunks = 0
        if drafter is not None:
            block = drafter.config.block_size
            device = self.draft_device
            self.block_ids = torch.full((1, block), drafter.config.mask_token_id, dtype=torch.long, device=device)
            self.draft_start = torch.zeros(1, dtype=torch.long, device=device)
            self.draft_new_rows = torch.zeros(1, dtype=torch.long, device=device)
            self.draft_features = torch.zeros(
                (1, block, drafter.config.feature_size), dtype=target.embed_tokens.weight.dtype, device=device
            )

    @property
    def target(self) -> CausalLM:
        target = self._target()
        if target is None:
            raise RuntimeError("the graph runner's target model was freed")
        return target

    # ---- caches ------------------------------------------------------------------------------------------
    def lease_target_cache(self, capacity: int) -> KVCache | None:
        return self._lease("target", self.target_storage, capacity)

    def lease_drafter_cache(self, capacity: int) -> KVCache | None:
        return None if self.drafter_storage is None else self._lease("drafter", self.drafter_storage, capacity)

    def _lease(self, name: str, storage: KVCache, capacity: int) -> KVCache | None:
        """A view of `storage` unless the previous one is still alive (then the caller allocates its own).

        Under tensor parallelism the ranks agree: a view only if every rank can lease one. A rank whose previous
        view lives on (a traceback holding it, say) would otherwise run this generation eagerly while the others
        replay graphs, and their collectives would no longer match (an eager prefill gathers the last row's
        logits, a graph all of its rows')."""
        previous = self._leases.get(name)
        free = capacity <= storage.capacity and (previous is None or previous() is None)
        if not self._all_ranks_agree(free):
            return None
        view = KVCache.view_of(storage, capacity)
        self._leases[name] = weakref.ref(view)
        return view

    def _all_ranks_agree(self, yes: bool) -> bool:
        """`yes` on every rank of the target's tensor-parallel run (just `yes` without one); a collective."""
        tensor_parallel = self.target.tensor_parallel
        if tensor_parallel is None or tensor_parallel.world == 1:
            return yes
        flag = torch.tensor([int(yes)], dtype=torch.int32, device=tensor_parallel.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=tensor_parallel.group)
        return bool(flag.item())

    def bucket_for(self, slots: int) -> int:
        return min(round_up_pow2(slots, MIN_BUCKET), self.capacity)

    # ---- target ------------------------------------------------------------------------------------------
    def target_forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor | None,
        cache: KVCache,
        tree_mask: torch.Tensor | None,
        capture: Sequence[int],
        logits: LogitsMode,
    ) -> ForwardOutput | None:
        """The graphed equivalent of `CausalLM.forward`, or None when this call is not a graph shape."""
        batch, seq = input_ids.shape
        # decode shapes (all logits: steps, verifications) pad to 1, 2, 4, 8, then multiples of 8; prefill chunks
        # (last or no logits) to powers of two, so the prompts' many lengths share a few graphs
        rows = padded_rows(seq) if logits == "all" else round_up_pow2(seq)
        past = cache.length
        if batch == 1 and rows > self.max_rows and logits != "all" and self.fuses_long_chunks:
            return self._fused_chunk(input_ids, positions, cache, capture, logits)
        if (
            batch != 1 or rows > self.max_rows
            or not cache.shares_memory_with(self.target_storage) or past + rows > self.capacity
        ):
            return None
        cache.reserve(seq)
        inputs = self.row_inputs(rows)
        inputs.input_ids[:, :seq].copy_(input_ids)
        if positions is None:
            inputs.positions[0, :seq].copy_(torch.arange(past, past + seq, device=self.device))
        else:
            inputs.positions[:, :seq].copy_(positions)
        if tree_mask is None:
            inputs.tree_mask.copy_(inputs.causal)
        else:
            if rows != seq:
                inputs.tree_mask.copy_(inputs.identity)
            inputs.tree_mask[:seq, :seq].copy_(tree_mask)
        self.length.fill_(past)
        bucket = self.bucket_for(past + rows)
        layers = tuple(capture)
        tree = tree_mask is not None
        key: tuple[object, ...] = ("target", rows, bucket, layers)
        if self.hybrid:  # a chain's state follows its live rows, a tree's rows their paths: graphs of their own
            self.live_rows.fill_(seq)
            key += (tree,)
        replay = self.replay(key, lambda: self._target_outputs(inputs, bucket, layers, tree))
        replay.run()
        self.served += 1
        if cache.recurrent is not None:  # the storage's: a replay does not run the host side of its writes
            assert isinstance(cache.recurrent, StaticRecurrentStates)
            cache.recurrent.note_forward(seq, tree=tree)
        cache.advance(seq)
        features = replay.outputs[1][:, :seq].clone() if layers else None
        if logits == "none":
            return ForwardOutput(None, features)
        first = 0 if logits == "all" else seq - 1
        return ForwardOutput(replay.outputs[0][:, first:seq].clone(), features)

    def _fused_chunk(
        self, input_ids: torch.Tensor, positions: torch.Tensor | None, cache: KVCache, capture: Sequence[int],
        logits: LogitsMode,
    ) -> ForwardOutput | None:
        """A prompt chunk longer than the graphs (a quantized target's, `GraphForwards.prefill_chunk`) through the
        fused layers, eagerly, into the runner's storage: a few launches a layer where the model's own layers take
        about twenty (such chunks were bound by the host); None where the storage does not serve the cache."""
        from dflash.fastpath.fused_layers import fused_layers, fused_logits

        seq, past = input_ids.shape[1], cache.length
        if not cache.shares_memory_with(self.target_storage) or past + seq > self.capacity:
            return None
        cache.reserve(seq)
        if positions is None:
            positions = torch.arange(past, past + seq, device=self.device)[None]
        self.length.fill_(past)
        causal = torch.ones(seq, seq, dtype=torch.bool, device=self.device).tril()
        hidden, features = fused_layers(
            self.target, self.target_storage, input_ids, positions, self.length, causal, self.bucket_for(past + seq),
            tuple(capture),
        )  # hidden: [1, seq, hidden]
        cache.advance(seq)
        self.fused_chunks += 1
        if logits == "none":
            return ForwardOutput(None, features)
        return ForwardOutput(fused_logits(self.target, hidden[0, -1:])[None], features)

    def _target_outputs(
        self, inputs: _RowInputs, bucket: int, layers: tuple[int, ...], tree: bool
    ) -> list[torch.Tensor]:
        from dflash.fastpath.static_forward import static_target_forward

        recurrent = self.target_storage.recurrent
        if recurrent is not None:  # what the linear layers read while the graph is built
            recurrent.tree_ancestors = inputs.tree_mask if tree else None
            recurrent.count_rows = None if tree else self.live_rows
        try:
            logits, features = static_target_forward(
                self.target, self.target_storage, inputs.input_ids, inputs.positions, self.length, inputs.tree_mask,
                bucket=bucket, capture=layers, fused=self.fused,
            )
        finally:
            if recurrent is not None:
                recurrent.tree_ancestors = recurrent.count_rows = None
        return [logits] if features is None else [logits, features]

    def row_inputs(self, rows: int) -> _RowInputs:
        if rows not in self._rows:
            causal = torch.ones(rows, rows, dtype=torch.bool, device=self.device).tril()
            self._rows[rows] = _RowInputs(
                input_ids=torch.zeros((1, rows), dtype=torch.long, device=self.device),
                positions=torch.zeros((1, rows), dtype=torch.long, device=self.device),
                tree_mask=causal.clone(),
                causal=causal,
                identity=torch.eye(rows, dtype=torch.bool, device=self.device),
            )
        return self._rows[rows]

    # ---- drafter -----------------------------------------------------------------------------------------
    def draft_logits(
        self, pending_token: int, start: int, new_features: torch.Tensor, cache: KVCache, drafts: int
    ) -> torch.Tensor | None:
        """The graphed equivalent of `DFlashDrafter.draft_scores(...).full()` (no window), or None for other shapes."""
        if self.drafter is None or not self._drafter_round_fits(start, new_features, cache):
            return None
        (logits,) = self._drafter_round("drafter", lambda b, d: [self.drafter_block_logits(b, d)], pending_token,
                                        start, new_features, cache, drafts)
        return logits

    def draft_chain(
        self, pending_token: int, start: int, new_features: torch.Tensor, cache: KVCache, drafts: int
    ) -> SelectedChain | None:
        """The graphed equivalent of a DFlash2 drafter's greedy `draft_chain` (no window): the round and its
        selector's walk in one graph; None for other shapes or drafters."""
        if not isinstance(self.drafter, DFlash2Drafter) or not self._drafter_round_fits(start, new_features, cache):
            return None
        tokens, candidates, q = self._drafter_round("dflash2 chain", self.dflash2_chain, pending_token, start,
                                                    new_features, cache, drafts)
        return SelectedChain(tokens, candidates, q)

    def _drafter_round(
        self, kind: str, build: Callable[[int, int], list[torch.Tensor]], pending_token: int, start: int,
        new_features: torch.Tensor, cache: KVCache, drafts: int,
    ) -> list[torch.Tensor]:
        """One drafter round (`_drafter_round_fits`) replayed from the graph of (`kind`, key bucket, drafts), built
        by `build(bucket, drafts)` -> copies of its outputs; `cache` advanced over the new context rows."""
        bucket = self._load_drafter_round(pending_token, start, new_features, cache)
        replay = self.replay((kind, bucket, drafts), lambda: build(bucket, drafts), self.draft_device)
        replay.run()
        self.served += 1
        cache.advance(new_features.shape[1])
        return [output.clone() for output in replay.outputs]

    def _drafter_round_fits(self, start: int, new_features: torch.Tensor, cache: KVCache) -> bool:
        assert self.drafter is not None
        block = self.drafter.config.block_size
        return (
            self.drafter_storage is not None and 1 <= new_features.shape[1] <= block
            and cache.shares_memory_with(self.drafter_storage) and cache.length + new_features.shape[1] == start
            and start + block <= self.capacity
        )

    def _load_drafter_round(self, pending_token: int, start: int, new_features: torch.Tensor, cache: KVCache) -> int:
        """A round's inputs into the static buffers (its new context rows reserved in `cache`) -> its key bucket."""
        assert self.drafter is not None
        new_rows = new_features.shape[1]
        cache.reserve(new_rows)
        self.draft_features[:, :new_rows].copy_(new_features)
        self.block_ids[0, 0] = pending_token
        self.draft_start.fill_(start)
        self.draft_new_rows.fill_(new_rows)
        return self.bucket_for(start + self.drafter.config.block_size)

    def dflash2_chain(self, bucket: int, drafts: int) -> list[torch.Tensor]:
        """A DFlash2 round and its selector's greedy walk from the pending token (nothing read back): [tokens
        [drafts], candidates [drafts, K], q [drafts, K]] (`SelectedChain`'s fields)."""
        assert isinstance(self.drafter, DFlash2Drafter)
        heads = self.draft_heads if self.draft_heads is not None else self.target
        hidden = self._drafter_hidden(bucket, drafts)
        lattice = self.drafter.candidate_selector.lattice(hidden, self.drafter.project_scores(heads, hidden))
        chain = lattice.walk(self.block_ids[0, :1])
        return [chain.tokens, chain.candidates, chain.q]

    def drafter_block_logits(self, bucket: int, drafts: int) -> torch.Tensor:
        assert self.drafter is not None and self.drafter_storage is not None
        heads = self.draft_heads if self.draft_heads is not None else self.target
        if self.drafter_weights is not None:
            from dflash.fastpath.fused_drafter import fused_drafter_round

            return fused_drafter_round(
                self.drafter, heads, self.drafter_storage, self.drafter_weights, self.block_ids,
                self.draft_start, self.draft_new_rows, self.draft_features, bucket=bucket, drafts=drafts,
            )
        return self.drafter.project(heads, self._drafter_hidden(bucket, drafts))

    def _drafter_hidden(self, bucket: int, drafts: int) -> torch.Tensor:
        from dflash.fastpath.static_forward import static_drafter_hidden

        assert self.drafter is not None and self.drafter_storage is not None
        heads = self.draft_heads if self.draft_heads is not None else self.target
        return static_drafter_hidden(
            self.drafter, heads, self.drafter_storage, self.block_ids, self.draft_start, self.draft_new_rows,
            self.draft_features, bucket=bucket, drafts=drafts,
        )

    # ---- capture -----------------------------------------------------------------------------------------
    def _capture_stream(self, device: torch.device) -> torch.cuda.Stream:
        stream = self._capture_streams.get(device)
        if stream is None:
            stream = self._capture_streams[device] = torch.cuda.Stream(device)
        return stream

    def has_replay(self, key: tuple[object, ...]) -> bool:
        """Whether `replay(key, ...)` returns a graph captured earlier (never on the eager path)."""
        return key in self._replays

    def replay(
        self, key: tuple[object, ...], build: Callable[[], list[torch.Tensor]], device: torch.device | None = None
    ) -> _Replay:
        """The replay of `key`, captured on first use from `build` on `device` (default: the target's)."""
        replay = self._replays.get(key)
        if replay is not None:
            return replay
        if not self.capture:
            eager = _Replay(run=lambda: None)

            def run_eagerly() -> None:
                eager.outputs = build()

            eager.run = run_eagerly
            return eager  # not kept: each call recomputes, there is nothing to capture
        device = device or self.device
        with torch.cuda.device(device):
            # torch's default capture stream belongs to the device current when it was first made (the target's):
            # another device's graph is captured on a stream of its own
            stream = None if device == self.device else self._capture_stream(device)
            pool = self.pool if device == self.device else self.draft_pool
            graph, outputs = capture_graph(build, pool, device=device, stream=stream)
        replay = _Replay(run=graph.replay if device == self.device else _on_device(graph, device), outputs=outputs)
        self._replays[key] = replay
        self.captured += 1
        log.debug("captured CUDA graph %s (%d so far)", key, self.captured)
        return replay


def _on_device(graph: torch.cuda.CUDAGraph, device: torch.device) -> Callable[[], None]:
    """`graph.replay` with `device` current (a graph captured on another GPU than the target's)."""

    def run() -> None:
        with torch.cuda.device(device):
            graph.replay()

    return run


def attach_graph_runner(
    target: CausalLM, drafter: DFlashDrafter | None, capacity: int, *, capture: bool = True,
    fused: bool | None = None, draft_heads: TargetHeads | None = None,
) -> GraphRunner:
    """Route the decoding loops' forwards of `target` and `drafter` through a new `GraphRunner`."""
    weight = target.embed_tokens.weight
    if target.config.is_hybrid and capture and weight.is_cuda and not delta_rule_program_serves(weight):
        raise GenerationError("a hybrid model's CUDA graphs need the delta rule's Triton program (Triton on CUDA)")
    runner = GraphRunner(target, drafter, capacity, capture=capture, fused=fused, draft_heads=draft_heads)
    register_forwards(target, GraphForwards(runner))
    return runner
