"""`DraftDeviceForwards`: the decoding loops' forwards when the drafter runs on a device of its own.

The target and its caches stay on the target's device; the drafter, its context cache and copies of the target's
embedding and LM head (`dflash.drafter.borrowed_heads.BorrowedHeads`) live on the drafter's. Each round the newly
committed positions' features [1, new, n*hidden] (a few KB) go to the drafter's device, and the draft logits
[drafts, vocab] come back. The copies follow the devices' current streams (PyTorch orders a copy between two GPUs
after the source's pending work and before the destination's next), so nothing here synchronises the host.

Target forwards, caches and prefill chunks are the wrapped `Forwards`' (a graph runner's where one serves the
target, whose drafter graphs then replay on the drafter's device). The device-resident decoder is not used: it
keeps a whole round, drafter included, on one device.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from typing import TYPE_CHECKING

import torch

from dflash.generation.forwards import Forwards

if TYPE_CHECKING:
    from dflash.drafter.borrowed_heads import BorrowedHeads
    from dflash.drafter.model import DFlashDrafter, TargetModel
    from dflash.drafter.vocab import DraftScores
    from dflash.fastpath.resident import ResidentDecoder
    from dflash.generation.selection import TokenChooser
    from dflash.kv.cache import KVCache
    from dflash.models.model import CausalLM, ForwardOutput, LogitsMode

__all__ = ["DraftDeviceForwards"]


class DraftDeviceForwards(Forwards):
    """`inner`'s forwards, with every drafter round run on `heads`' device and its scores returned to the target's."""

    def __init__(self, inner: Forwards, heads: BorrowedHeads, target_device: torch.device) -> None:
        self.inner = inner
        self.heads = heads
        self.target_device = target_device
        self.draft_device = heads.embed_tokens.weight.device

    def forward(
        self,
        target: CausalLM,
        input_ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        cache: KVCache | None = None,
        *,
        tree_mask: torch.Tensor | None = None,
        capture: Sequence[int] = (),
        logits: LogitsMode = "all",
    ) -> ForwardOutput:
        return self.inner.forward(
            target, input_ids, positions, cache, tree_mask=tree_mask, capture=capture, logits=logits
        )

    def new_target_cache(self, target: CausalLM, capacity: int) -> KVCache:
        return self.inner.new_target_cache(target, capacity)

    def draft_scores(
        self,
        drafter: DFlashDrafter,
        target: TargetModel,
        pending_token: int,
        start: int,
        new_features: torch.Tensor,
        cache: KVCache,
        *,
        window: int | None = None,
        num_drafts: int | None = None,
    ) -> DraftScores:
        from dflash.drafter.vocab import DraftScores

        features = new_features.to(self.draft_device, non_blocking=True)  # [1, new, n*hidden]
        # kernels that launch on the current device (Triton's) must find the drafter's current
        current = torch.cuda.device(self.draft_device) if self.draft_device.type == "cuda" else nullcontext()
        with current:
            scores = self.inner.draft_scores(
                drafter, self.heads, pending_token, start, features, cache, window=window, num_drafts=num_drafts
            )
        ids = None if scores.ids is None else scores.ids.to(self.target_device, non_blocking=True)
        return DraftScores(scores.logits.to(self.target_device, non_blocking=True), ids, scores.vocab_size)

    def new_drafter_cache(self, drafter: DFlashDrafter, capacity: int) -> KVCache:
        return self.inner.new_drafter_cache(drafter, capacity)

    def absorb_draft_context(
        self, drafter: DFlashDrafter, features: torch.Tensor, start: int, cache: KVCache
    ) -> None:
        current = torch.cuda.device(self.draft_device) if self.draft_device.type == "cuda" else nullcontext()
        with current:
            self.inner.absorb_draft_context(drafter, features.to(self.draft_device, non_blocking=True), start, cache)

    def prefill_chunk(self, chunk: int) -> int:
        return self.inner.prefill_chunk(chunk)

    def resident(
        self,
        target: CausalLM,
        chooser: TokenChooser,
        target_cache: KVCache,
        *,
        drafter: DFlashDrafter | None = None,
        drafter_cache: KVCache | None = None,
        drafts: int = 0,
        capture: tuple[int, ...] = (),
        budget: int | None = None,
    ) -> ResidentDecoder | None:
        if drafter is not None:
            return None  # the resident decoder runs drafter and target on one device
        return self.inner.resident(target, chooser, target_cache, capture=capture, budget=budget)
