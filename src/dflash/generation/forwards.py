"""`Forwards`: how the decoding loops run the target and the drafter.

The models only compute. Whether a call runs a model's own (eager) forward or something faster, such as a replayed
CUDA graph, is the decoding side's choice: the loops call the models through a `Forwards`, by default the one
registered for their target (`forwards_for`). That is the eager `Forwards` here unless the GPU fast path registered
its own (`dflash.fastpath.runner.attach_graph_runner` registers a `dflash.fastpath.dispatch.GraphForwards`).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from dflash.drafter.dflash2 import DFlash2Drafter
    from dflash.drafter.model import DFlashDrafter, TargetModel
    from dflash.drafter.selector import SelectedChain
    from dflash.drafter.vocab import DraftScores
    from dflash.fastpath.resident import ResidentDecoder
    from dflash.generation.selection import TokenChooser
    from dflash.kv.cache import KVCache
    from dflash.models.model import CausalLM, ForwardOutput, LogitsMode


class Forwards:
    """The eager forwards: every call goes straight to the model. A subclass serves what it can another way and
    falls back to these for the rest; for the same inputs it must give the same results (the loops are lossless
    whichever serves them)."""

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
        """`CausalLM.forward` of one sequence: input_ids, positions [1, seq]; tree_mask [seq, seq] or None."""
        return target(input_ids, positions, cache, tree_mask=tree_mask, capture=capture, logits=logits)

    def new_target_cache(self, target: CausalLM, capacity: int) -> KVCache:
        """An empty K/V cache of `capacity` slots for one generation."""
        return target.new_cache(capacity)

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
        """One drafter round (`DFlashDrafter.draft_scores`)."""
        return drafter.draft_scores(
            target, pending_token, start, new_features, cache, window=window, num_drafts=num_drafts
        )

    def draft_chain(
        self,
        drafter: DFlash2Drafter,
        target: TargetModel,
        pending_token: int,
        start: int,
        new_features: torch.Tensor,
        cache: KVCache,
        *,
        window: int | None = None,
        num_drafts: int | None = None,
        temperature: float = 0.0,
        generator: torch.Generator | None = None,
    ) -> SelectedChain:
        """One DFlash2 round and its selector's walk (`DFlash2Drafter.draft_chain`)."""
        return drafter.draft_chain(
            target, pending_token, start, new_features, cache, window=window, num_drafts=num_drafts,
            temperature=temperature, generator=generator,
        )

    def new_drafter_cache(self, drafter: DFlashDrafter, capacity: int) -> KVCache:
        """An empty drafter context cache of `capacity` slots for one generation."""
        return drafter.new_cache(capacity)

    def absorb_draft_context(
        self, drafter: DFlashDrafter, features: torch.Tensor, start: int, cache: KVCache
    ) -> None:
        """Committed context rows into the drafter's cache ahead of its rounds (`DFlashDrafter.absorb_context`):
        features [1, rows, n*hidden] of positions start .. start + rows - 1, which must follow cache.length."""
        import torch

        positions = torch.arange(start, start + features.shape[1], device=drafter.fc.weight.device)[None]
        drafter.absorb_context(features.to(drafter.fc.weight.device), positions, cache)

    def prefill_chunk(self, chunk: int) -> int:
        """The prefill chunk to use when `chunk` is asked for."""
        return chunk

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
        """A decoder that can take over this generation's greedy rounds on the device (`dflash.fastpath.resident`),
        or None: the host loop runs every round. Eager forwards have none."""
        return None


EAGER = Forwards()

# Weak keys: registering forwards must not keep a model alive; the forwards themselves must not hold their target
# strongly either, or the entry would never go.
_registered: weakref.WeakKeyDictionary[CausalLM, Forwards] = weakref.WeakKeyDictionary()


def forwards_for(target: CausalLM) -> Forwards:
    """The forwards the decoding loops use for `target` (and its drafter) when given none."""
    return _registered.get(target, EAGER)


def register_forwards(target: CausalLM, forwards: Forwards | None) -> None:
    """Route the decoding loops' calls on `target` and its drafter through `forwards` (None: eager again)."""
    if forwards is None or forwards is EAGER:
        _registered.pop(target, None)
    else:
        _registered[target] = forwards
