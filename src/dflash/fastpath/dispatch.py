"""`GraphForwards`: the decoding loops' forwards served by a `GraphRunner` where it can, eagerly otherwise.

The models know nothing of CUDA graphs. `attach_graph_runner` registers a `GraphForwards` for the runner's target
(`dflash.generation.forwards.register_forwards`); the loops then run a call through the runner when it is one of
its shapes on one of its caches (the runner answers None otherwise) and through the model's own forward when not.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from dflash.generation.forwards import Forwards, forwards_for

if TYPE_CHECKING:
    import torch

    from dflash.drafter.dflash2 import DFlash2Drafter
    from dflash.drafter.model import DFlashDrafter, TargetModel
    from dflash.drafter.selector import SelectedChain
    from dflash.drafter.vocab import DraftScores
    from dflash.fastpath.resident import ResidentDecoder
    from dflash.fastpath.runner import GraphRunner
    from dflash.generation.selection import TokenChooser
    from dflash.kv.cache import KVCache
    from dflash.models.model import CausalLM, ForwardOutput, LogitsMode


QUANTIZED_PREFILL_CHUNK = 1024


class GraphForwards(Forwards):
    """Forwards of `runner.target` and `runner.drafter` through `runner`; other models stay eager."""

    def __init__(self, runner: GraphRunner) -> None:
        self.runner = runner
        # every eager chunk past the graphs' rows dequantises each quantized matrix once: fewer, longer chunks
        # (quantized GPU modules exist only where their module was loaded)
        quantized = sys.modules.get("dflash.models.gpu_quantized_layers")
        self._quantized = quantized is not None and quantized.uses_gpu_quantized_weights(runner.target)
        runner.fuses_long_chunks = self._quantized and runner.fused and not runner.hybrid

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
        if cache is not None and target is self.runner.target:
            graphed = self.runner.target_forward(input_ids, positions, cache, tree_mask, capture, logits)
            if graphed is not None:
                return graphed
        return super().forward(
            target, input_ids, positions, cache, tree_mask=tree_mask, capture=capture, logits=logits
        )

    def new_target_cache(self, target: CausalLM, capacity: int) -> KVCache:
        """A view of the runner's storage (so its graphs serve the generation) while no other view is alive."""
        if target is self.runner.target:
            leased = self.runner.lease_target_cache(capacity)
            if leased is not None:
                return leased
        return super().new_target_cache(target, capacity)

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
        if drafter is self.runner.drafter and window is None:
            from dflash.drafter.vocab import DraftScores

            last = drafter.config.block_size if num_drafts is None else 1 + num_drafts
            graphed = self.runner.draft_logits(pending_token, start, new_features, cache, last - 1)
            if graphed is not None:  # [drafts, vocab]: the graphs spread a shortlist over the whole vocabulary
                return DraftScores(graphed, None, graphed.shape[-1])
        return super().draft_scores(
            drafter, target, pending_token, start, new_features, cache, window=window, num_drafts=num_drafts
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
        if drafter is self.runner.drafter and window is None and temperature <= 0.0:  # greedy: no draws
            last = drafter.config.block_size if num_drafts is None else 1 + num_drafts
            graphed = self.runner.draft_chain(pending_token, start, new_features, cache, last - 1)
            if graphed is not None:
                return graphed
        return super().draft_chain(
            drafter, target, pending_token, start, new_features, cache, window=window, num_drafts=num_drafts,
            temperature=temperature, generator=generator,
        )

    def new_drafter_cache(self, drafter: DFlashDrafter, capacity: int) -> KVCache:
        if drafter is self.runner.drafter:
            leased = self.runner.lease_drafter_cache(capacity)
            if leased is not None:
                return leased
        return super().new_drafter_cache(drafter, capacity)

    def prefill_chunk(self, chunk: int) -> int:
        """No larger than the runner's graphs (eager prefill chunks are launch-bound on a GPU), except for a target
        whose matrices stay quantized: its long chunks are bound by dequantising every matrix per chunk."""
        return max(chunk, QUANTIZED_PREFILL_CHUNK) if self._quantized else min(chunk, self.runner.max_rows)

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
        if target is not self.runner.target or target.tensor_parallel is not None or target.config.is_hybrid:
            # under tensor parallelism every token choice goes through the ranks' agreement (`dflash.parallel.spmd`),
            # which the resident decoder's on-device choices would bypass; a hybrid's rounds end in its recurrent
            # state's host-side rollback (`dflash.kv.static_recurrent`), which resident rounds would skip
            return None
        from dflash.fastpath.resident import resident_decoder

        return resident_decoder(
            self.runner, chooser, target_cache, drafter=drafter, drafter_cache=drafter_cache, drafts=drafts,
            capture=capture, budget=budget,
        )


def graph_runner_of(target: CausalLM) -> GraphRunner | None:
    """The runner serving `target`'s decoding loops, None when they run eagerly."""
    from dflash.generation.draft_device import DraftDeviceForwards

    forwards = forwards_for(target)
    while isinstance(forwards, DraftDeviceForwards):  # a drafter on its own device: the target's forwards inside
        forwards = forwards.inner
    return forwards.runner if isinstance(forwards, GraphForwards) else None
