"""One decoding step for many rows over a shared left-padded cache, replayed from CUDA graphs.

Offline batched work (answering training prompts, exact replay) steps every row of a batch once per new token.
Run eagerly, that step is bound by the host: a 135M-parameter model issues the same few hundred small launches at
any batch size, and the device waits for them. Here the step has fixed shapes and addresses, so it is captured once
per key *bucket* (a multiple of `STEP_BUCKET` slots) and replayed: the new keys/values go to a device-held slot,
attention reads the bucket's slots, and a mask built from the cache's recorded positions hides left pads (they carry
`PAD_POSITION`) and the slots past the live ones (reset to `PAD_POSITION` for every batch). Without CUDA the same
function runs eagerly, which is how the CPU tests check it against the eager path.
"""

from __future__ import annotations

import torch

from dflash.fastpath.capture import capture_graph
from dflash.fastpath.static_forward import SlotWriter
from dflash.kv.cache import KVCache
from dflash.models.model import CausalLM, causal_by_position

STEP_BUCKET = 128
PAD_POSITION = 1 << 30  # the position of a pad and of a free slot: after every real position, seen by none


def batched_step_forward(
    model: CausalLM, cache: KVCache, tokens: torch.Tensor, positions: torch.Tensor, slot: torch.Tensor, bucket: int
) -> torch.Tensor:
    """tokens, positions: [batch, 1]; slot: [1] long (where the new K/V go) -> logits [batch, vocab] of the next
    token, attending over the first `bucket` slots of `cache`."""
    cache.positions.index_copy_(1, slot, positions)
    key_positions = cache.positions[:, :bucket]  # [batch, bucket]
    full = causal_by_position(positions, key_positions)  # [batch, 1, 1, bucket]
    sliding = None
    window = model.sliding_window
    if window is not None:
        sliding = full & (positions[:, :, None] - key_positions[:, None, :] < window)[:, None]
    x, _ = model.run_layers(tokens, positions, full, sliding, SlotWriter(cache, slot, bucket), ())
    logits = model.finish(x, None, "last").logits
    assert logits is not None
    return logits[:, -1]


class BatchedDecoder:
    """A cache of `capacity` slots for `batch` rows and the captured step of each bucket, reused batch after batch.

    Per batch: `start()` hands out the emptied cache for the prompt's eager forward, then `step(...)` once per new
    token. `capture=None` captures CUDA graphs when the model is on a CUDA device and runs eagerly otherwise."""

    def __init__(self, model: CausalLM, batch: int, capacity: int, *, capture: bool | None = None) -> None:
        device = model.embed_tokens.weight.device
        self.model, self.batch, self.capacity = model, batch, capacity
        # a target whose forward is not fixed by its shapes (`CausalLM.capturable`) steps eagerly
        self.capture = device.type == "cuda" and model.capturable if capture is None else capture
        self.cache = model.new_cache(capacity, batch)
        self.tokens = torch.zeros((batch, 1), dtype=torch.long, device=device)
        self.positions = torch.zeros((batch, 1), dtype=torch.long, device=device)
        self.slot = torch.zeros(1, dtype=torch.long, device=device)
        self.pool = torch.cuda.graph_pool_handle() if self.capture else None
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def fits(self, batch: int, slots: int) -> bool:
        return batch == self.batch and slots <= self.capacity

    def start(self) -> KVCache:
        """The cache, emptied, every slot marked free."""
        self.cache.crop(0)
        self.cache.positions.fill_(PAD_POSITION)
        return self.cache

    def step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """tokens, positions: [batch] long, stored at the cache's next slot -> logits [batch, vocab] (a buffer the
        next step overwrites)."""
        slot = self.cache.length
        if slot >= self.capacity:
            raise ValueError(f"the batched cache holds {self.capacity} slots; slot {slot} does not fit")
        bucket = min(self.capacity, -(-(slot + 1) // STEP_BUCKET) * STEP_BUCKET)
        self.tokens.copy_(tokens[:, None])
        self.positions.copy_(positions[:, None])
        self.slot.fill_(slot)
        self.cache.advance(1)
        if not self.capture:
            return batched_step_forward(self.model, self.cache, self.tokens, self.positions, self.slot, bucket)
        graph, logits = self.graphs.get(bucket) or self._capture(bucket)
        graph.replay()
        return logits

    def _capture(self, bucket: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        def forward() -> torch.Tensor:
            return batched_step_forward(self.model, self.cache, self.tokens, self.positions, self.slot, bucket)

        # the warm-up call rewrites this step's slot only
        graph, logits = capture_graph(forward, self.pool, device=self.tokens.device)
        self.graphs[bucket] = (graph, logits)
        return graph, logits
