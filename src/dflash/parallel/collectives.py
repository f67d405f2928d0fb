"""The sum that ends each row-parallel sub-layer: every rank's partial output, added up on every rank.

Four ways to do it, chosen once per run by `DFLASH_TP_ALLREDUCE` (auto | nccl | symmetric | fused | oneway):

* `nccl`: the process group's `all_reduce` (gloo on CPU ranks). Any size; inside a CUDA graph an all-reduce of one
  residual row still takes ~18 us on two NVLink-connected GPUs (`results/gpu_tensor_parallel_*.json`), and a
  decoding step runs two per layer.
* `symmetric`: PyTorch's symmetric memory (`torch.distributed._symmetric_memory`): each rank owns a buffer every
  other rank can read over NVLink; one kernel copies the partial sum into it, meets the other ranks at a barrier,
  and adds every rank's buffer in rank order (the "one-shot" all-reduce), ~7 us for the same row. Tensors larger
  than the buffer (long prefill chunks) go through NCCL. It needs GPUs that reach each other's memory
  (peer access) and the operators of PyTorch's symmetric memory; multicast stays off (`dflash.parallel.group`).

* `fused`: the symmetric buffer without the separate all-reduce: where the sum feeds an add+RMSNorm (every
  row-parallel projection of the fused forward does), one program per row stores the partial, meets the peers,
  adds every rank's row and does the add+RMSNorm (`add_rms_norm`, `dflash.kernels.triton_rank_sums`): one launch
  instead of two. Other sums take the one-shot all-reduce.
* `oneway`: `fused` without its flags: the rows carry their own arrival (a slot holds an "unwritten" bit pattern
  until the peer's row lands; `oneway_sum_add_rms_norm`), so a sum costs one trip over NVLink where `fused` has the
  row, a system-wide fence, then the flag.

`auto` takes `oneway` where the symmetric buffer can be set up and Triton is there, `symmetric` without Triton, NCCL
otherwise. All give every rank the same sum bit for bit (NCCL's ring hands one reduced copy to all; the symmetric
kernels add in the same order on every rank), which keeps the ranks' logits, and so their greedy choices,
identical.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from dflash import environment
from dflash.errors import DFlashError

__all__ = ["SYMMETRIC_ROWS", "PartialSums"]

SumAndNorm = tuple[torch.Tensor, torch.Tensor]

log = logging.getLogger("dflash.parallel")

# Rows of the residual stream the symmetric buffer holds: every decoding shape (steps, verifications, trees,
# drafted blocks, the graph runner's prefill chunks) fits; longer prefill chunks use NCCL, where bandwidth decides.
SYMMETRIC_ROWS = 128

FOLDED = ("fused", "oneway")  # the modes whose sums are folded into the add+RMSNorm


class PartialSums:
    """`sum(partial)`: the element-wise sum of `partial` over the ranks of `group`, on every rank."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device, mode: str | None = None) -> None:
        self.group = group
        self.device = device
        self.asked = mode or environment.tp_allreduce()
        if self.asked not in environment.TP_ALLREDUCE_CHOICES:
            choices = ", ".join(environment.TP_ALLREDUCE_CHOICES)
            raise DFlashError(f"unknown all-reduce {self.asked!r}; choose one of {choices}")
        self.mode = "nccl"  # until `prepare` sets up the symmetric buffer
        self._buffer: torch.Tensor | None = None  # [SYMMETRIC_ROWS * width] of the one-shot all-reduce
        self._group_name = ""
        self._folding: _Folding | None = None  # the fused sums' buffer regions and flags, where set up

    def prepare(self, width: int, dtype: torch.dtype) -> str:
        """Set up the symmetric buffer for rows of `width` elements of `dtype` where the mode allows it; every
        rank must call this at the same point (it is a collective). Returns the mode in use."""
        if self.asked == "nccl" or self.device.type != "cuda":
            if self.asked in (*FOLDED, "symmetric"):
                raise DFlashError(f"DFLASH_TP_ALLREDUCE={self.asked} needs CUDA ranks")
            return self.mode
        try:
            self._buffer, self._folding = self._symmetric_buffer(width, dtype)
            if self._folding is None or self.asked == "symmetric":
                self.mode = "symmetric"
            else:
                self.mode = "oneway" if self.asked == "auto" else self.asked
        except Exception as exc:  # any failure of the alpha API means: use NCCL
            if self.asked in (*FOLDED, "symmetric"):
                raise DFlashError(
                    f"DFLASH_TP_ALLREDUCE={self.asked}: symmetric memory is not usable here: {exc}"
                ) from exc
            log.info("symmetric-memory all-reduce unavailable (%s); using NCCL", exc)
        return self.mode

    def _symmetric_buffer(self, width: int, dtype: torch.dtype) -> tuple[torch.Tensor, _Folding | None]:
        """The one-shot all-reduce's staging rows, then the fused sums' two regions (with their flags in the
        signal pads) and the one-way sums' two regions, in the same symmetric allocation, where Triton is there and
        the signal pads have room."""
        import torch.distributed._symmetric_memory as symm_mem

        from dflash.kernels.triton_decode import triton_available
        from dflash.kernels.triton_rank_sums import REGIONS, fill_unwritten

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
        staging = SYMMETRIC_ROWS * width  # the one-shot all-reduce's rows
        region = ranks * staging  # a fused region: a slot of rows per sending rank
        oneway_start = staging + REGIONS * region
        allocation = symm_mem.empty(oneway_start + REGIONS * region, dtype=dtype, device=self.device)
        handle = symm_mem.rendezvous(allocation, self.group)
        flags = REGIONS * SYMMETRIC_ROWS * ranks
        pad_flags = int(handle.signal_pad_size) // 4
        folding = None
        if self.asked != "symmetric" and triton_available() and pad_flags >= 2 * flags:
            every = range(ranks)
            folding = _Folding(
                buffers=torch.tensor([handle.get_buffer(r, [1], dtype).data_ptr() for r in every],
                                     dtype=torch.int64, device=self.device),
                pads=torch.tensor([handle.get_signal_pad(r, [1], torch.int32).data_ptr() for r in every],
                                  dtype=torch.int64, device=self.device),
                rank=handle.rank, world=ranks, width=width, dtype=dtype, first_region=staging, region=region,
                first_flag=pad_flags - flags, first_oneway_region=oneway_start,
            )
            fill_unwritten(allocation[oneway_start:])
            torch.cuda.synchronize(self.device)
            dist.barrier(group=self.group)  # no peer's row lands before this rank's regions were cleared
        elif self.asked in FOLDED:
            raise RuntimeError(f"no Triton, or a signal pad of {pad_flags} flags (the fused sums need {2 * flags})")
        return allocation[:staging], folding

    def use(self, mode: str) -> None:
        """Switch between "nccl" and a prepared "symmetric" all-reduce (graphs captured before keep the old one)."""
        if mode == "symmetric" and self._buffer is None:
            raise DFlashError("the symmetric all-reduce was not set up (prepare) on this run")
        if mode in FOLDED and self._folding is None:
            raise DFlashError(f"the {mode} sums were not set up (prepare) on this run")
        if mode not in ("nccl", "symmetric", *FOLDED):
            raise DFlashError(f"unknown all-reduce {mode!r}; choose nccl, symmetric, fused or oneway")
        self.mode = mode

    def add_rms_norm(
        self, partial: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, region: int
    ) -> SumAndNorm:
        """`triton_decode.add_rms_norm(sum(partial), residual, weight, eps)` with the sum over the ranks: partial,
        residual [rows, width] -> (RMSNorm(sum + residual) * weight, sum + residual). In `fused` and `oneway` modes
        one kernel where the rows fit the buffer; `region` (0 or 1) must alternate between consecutive calls."""
        folding = self._folding
        if (
            self.mode in FOLDED and folding is not None and partial.dtype == folding.dtype
            and partial.dim() == 2 and partial.shape[0] <= SYMMETRIC_ROWS and partial.shape[1] == folding.width
            and partial.is_contiguous() and (residual is None or residual.is_contiguous())
        ):
            from dflash.kernels.triton_rank_sums import oneway_sum_add_rms_norm, sum_add_rms_norm

            if self.mode == "oneway":
                return oneway_sum_add_rms_norm(
                    partial, residual, weight, eps, buffers=folding.buffers, rank=folding.rank, world=folding.world,
                    capacity=SYMMETRIC_ROWS, region_offset=folding.first_oneway_region + region * folding.region,
                )
            return sum_add_rms_norm(
                partial, residual, weight, eps, buffers=folding.buffers, pads=folding.pads, rank=folding.rank,
                world=folding.world, capacity=SYMMETRIC_ROWS,
                region_offset=folding.first_region + region * folding.region,
                first_flag=folding.first_flag + region * SYMMETRIC_ROWS * folding.world,
            )
        from dflash.kernels.triton_decode import add_rms_norm

        summed = self(partial)
        return add_rms_norm(summed, residual, weight, eps)

    def __call__(self, partial: torch.Tensor) -> torch.Tensor:
        """partial: any shape -> the sum over the ranks, same shape (a new tensor, or `partial` summed in place)."""
        buffer = self._buffer
        if (
            self.mode in ("symmetric", *FOLDED) and buffer is not None
            and partial.numel() <= buffer.numel() and partial.dtype == buffer.dtype
        ):
            staging = buffer[: partial.numel()].view(partial.shape)
            summed: torch.Tensor = torch.ops.symm_mem.one_shot_all_reduce_copy(
                staging, partial.contiguous(), "sum", self._group_name
            )
            return summed
        dist.all_reduce(partial, group=self.group)
        return partial


@dataclass(frozen=True)
class _Folding:
    """Where the fused sums meet: every rank's allocation and signal pad (device addresses), the regions' size."""

    buffers: torch.Tensor  # [world] int64
    pads: torch.Tensor  # [world] int64
    rank: int
    world: int
    width: int  # elements of a row
    dtype: torch.dtype
    first_region: int  # where the regions start in the allocation (elements): after the one-shot rows
    region: int  # elements of one region: SYMMETRIC_ROWS rows per sending rank
    first_flag: int  # the first int32 flag of the pads the fused sums use
    first_oneway_region: int  # where the one-way sums' regions start (elements)
