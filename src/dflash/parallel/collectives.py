"""The sum that ends each row-parallel sub-layer: every rank's partial output, added up on every rank.

Two ways to do it, chosen once per run by `DFLASH_TP_ALLREDUCE` (auto | nccl | symmetric):

* `nccl`: the process group's `all_reduce` (gloo on CPU ranks). Any size; inside a CUDA graph an all-reduce of one
  residual row still takes ~18 us on two NVLink-connected GPUs (`results/gpu_tensor_parallel_*.json`), and a
  decoding step runs two per layer.
* `symmetric`: PyTorch's symmetric memory (`torch.distributed._symmetric_memory`): each rank owns a buffer every
  other rank can read over NVLink; one kernel copies the partial sum into it, meets the other ranks at a barrier,
  and adds every rank's buffer in rank order (the "one-shot" all-reduce), ~7 us for the same row. Tensors larger
  than the buffer (long prefill chunks) go through NCCL. It needs GPUs that reach each other's memory
  (peer access) and the operators of PyTorch's symmetric memory; multicast stays off (`dflash.parallel.group`).

`auto` takes `symmetric` where it can be set up and NCCL otherwise. Both give every rank the same sum bit for bit
(NCCL's ring hands one reduced copy to all; the one-shot kernel adds in the same order on every rank), which keeps
the ranks' logits, and so their greedy choices, identical.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

from dflash import environment
from dflash.errors import DFlashError

__all__ = ["SYMMETRIC_ROWS", "PartialSums"]

log = logging.getLogger("dflash.parallel")

# Rows of the residual stream the symmetric buffer holds: every decoding shape (steps, verifications, trees,
# drafted blocks, the graph runner's prefill chunks) fits; longer prefill chunks use NCCL, where bandwidth decides.
SYMMETRIC_ROWS = 128


class PartialSums:
    """`sum(partial)`: the element-wise sum of `partial` over the ranks of `group`, on every rank."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device, mode: str | None = None) -> None:
        self.group = group
        self.device = device
        self.asked = mode or environment.tp_allreduce()
        if self.asked not in environment.TP_ALLREDUCE_CHOICES:
            raise DFlashError(f"unknown all-reduce {self.asked!r}; choose one of auto, nccl, symmetric")
        self.mode = "nccl"  # until `prepare` sets up the symmetric buffer
        self._buffer: torch.Tensor | None = None  # [SYMMETRIC_ROWS * width] in symmetric memory
        self._group_name = ""

    def prepare(self, width: int, dtype: torch.dtype) -> str:
        """Set up the symmetric buffer for rows of `width` elements of `dtype` where the mode allows it; every
        rank must call this at the same point (it is a collective). Returns the mode in use."""
        if self.asked == "nccl" or self.device.type != "cuda":
            if self.asked == "symmetric":
                raise DFlashError("DFLASH_TP_ALLREDUCE=symmetric needs CUDA ranks")
            return self.mode
        try:
            self._buffer = self._symmetric_buffer(SYMMETRIC_ROWS * width, dtype)
            self.mode = "symmetric"
        except Exception as exc:  # any failure of the alpha API means: use NCCL
            if self.asked == "symmetric":
                raise DFlashError(f"DFLASH_TP_ALLREDUCE=symmetric: symmetric memory is not usable here: {exc}") from exc
            log.info("symmetric-memory all-reduce unavailable (%s); using NCCL", exc)
        return self.mode

    def _symmetric_buffer(self, elements: int, dtype: torch.dtype) -> torch.Tensor:
        import torch.distributed._symmetric_memory as symm_mem

        ranks = dist.get_world_size(self.group)
        index = self.device.index or 0
        peers = [r for r in range(torch.cuda.device_count()) if r != index][: ranks - 1]
        if not all(torch.cuda.can_device_access_peer(index, peer) for peer in peers):
            raise RuntimeError("the GPUs cannot read each other's memory (no peer access)")
        if not hasattr(torch.ops.symm_mem, "one_shot_all_reduce_copy"):
            raise RuntimeError("this PyTorch has no symm_mem.one_shot_all_reduce_copy")
        self._group_name = self.group.group_name
        enable: Any = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is not None:  # required by older releases, a no-op (with a deprecation warning) in newer ones
            import warnings

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                enable(self._group_name)
        buffer = symm_mem.empty(elements, dtype=dtype, device=self.device)
        symm_mem.rendezvous(buffer, self.group)
        return buffer

    def use(self, mode: str) -> None:
        """Switch between "nccl" and a prepared "symmetric" all-reduce (graphs captured before keep the old one)."""
        if mode == "symmetric" and self._buffer is None:
            raise DFlashError("the symmetric all-reduce was not set up (prepare) on this run")
        if mode not in ("nccl", "symmetric"):
            raise DFlashError(f"unknown all-reduce {mode!r}; choose nccl or symmetric")
        self.mode = mode

    def __call__(self, partial: torch.Tensor) -> torch.Tensor:
        """partial: any shape -> the sum over the ranks, same shape (a new tensor, or `partial` summed in place)."""
        buffer = self._buffer
        if (
            self.mode == "symmetric" and buffer is not None
            and partial.numel() <= buffer.numel() and partial.dtype == buffer.dtype
        ):
            staging = buffer[: partial.numel()].view(partial.shape)
            summed: torch.Tensor = torch.ops.symm_mem.one_shot_all_reduce_copy(
                staging, partial.contiguous(), "sum", self._group_name
            )
            return summed
        dist.all_reduce(partial, group=self.group)
        return partial
