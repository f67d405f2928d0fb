"""The batched core's settings (`dflash.batch.core.BatchCore`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CoreSettings:
    max_batch: int
    prefill_chunk: int
    pool_tokens: int  # target (and drafter) positions the pools hold, over every request
    ddtree_budget: int
    linear_drafts: int
    max_step_rows: int
    draft_window: int | None = None
    cuda_graphs: bool = False  # on a CUDA device, replay the decoding rows' target pass as graphs
    prefill_chunks_per_step: int = 1  # prompt chunks a step may prefill (more where a chunk costs little: GPUs)
    # the decoding rows through the fixed-shape passes of `cuda_graphs`, run eagerly on any device: the CUDA path's
    # host work, tested and measured on the CPU
    eager_padded: bool = False
    # plain steps through those passes launched one ahead of reading their tokens (`dflash.batch.overlap`)
    overlap: bool = True
