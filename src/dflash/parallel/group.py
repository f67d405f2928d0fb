"""The process groups of a tensor-parallel run: one rank per device, NCCL between GPUs, gloo between CPU ranks.

Two groups: `group` carries the all-reduce of every row-parallel projection and the small per-round agreements of
a generation; `control` (gloo, on the CPU, with a timeout of days) carries the requests the first rank hands out.
Ranks other than the first wait in `control` while the server is idle: a wait in NCCL would spin a GPU kernel
and be ended by NCCL's watchdog after its timeout.
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from dflash.errors import DFlashError
from dflash.parallel.collectives import PartialSums

__all__ = ["IDLE_TIMEOUT", "TensorParallel", "multicast_off", "start_tensor_parallel", "stop_tensor_parallel"]

# How long a rank may wait for the next request (an idle server hands out none).
IDLE_TIMEOUT = timedelta(days=365)
# NVLink multicast stays off in NCCL, PyTorch's symmetric memory and NVSHMEM: a program using it can put a shared
# host's GPUs out of service, and two or four ranks gain little from it.
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def multicast_off() -> None:
    """Set the variables that keep NVLink multicast off (before any communicator exists)."""
    os.environ.update(MULTICAST_OFF)


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in a tensor-parallel run."""

    rank: int
    world: int
    device: torch.device
    group: dist.ProcessGroup  # collectives of the forward and of each round (NCCL on GPUs, gloo on CPUs)
    control: dist.ProcessGroup  # requests and shutdown (gloo)
    sums: PartialSums  # the all-reduce of the row-parallel projections (`dflash.parallel.collectives`)

    @property
    def leader(self) -> bool:
        """The first rank: it serves the requests and decides what the others do."""
        return self.rank == 0


def start_tensor_parallel(
    rank: int, world: int, device_type: str = "cuda", timeout: timedelta | None = None
) -> TensorParallel:
    """Join the run of `world` ranks as `rank` (MASTER_ADDR / MASTER_PORT name the rendezvous). On CUDA, rank r
    drives GPU r. `timeout` bounds every collective, the wait for requests included (default: the backend's
    timeout for collectives, `IDLE_TIMEOUT` for the wait)."""
    if world < 1 or not 0 <= rank < world:
        raise DFlashError(f"rank {rank} is not in a run of {world} ranks")
    multicast_off()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        raise DFlashError("MASTER_PORT is not set: start the ranks through dflash.parallel.launch")
    if device_type == "cuda":
        if torch.cuda.device_count() < world:
            raise DFlashError(f"--tensor-parallel {world} needs {world} GPUs, {torch.cuda.device_count()} visible")
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device, timeout=timeout)
    elif device_type == "cpu":
        device = torch.device("cpu")
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
    else:
        raise DFlashError(f"tensor parallelism runs on cuda or cpu devices, not {device_type!r}")
    group = dist.group.WORLD
    assert group is not None
    control = dist.new_group(backend="gloo", timeout=timeout or IDLE_TIMEOUT)
    return TensorParallel(
        rank=rank, world=world, device=device, group=group, control=control, sums=PartialSums(group, device)
    )


def stop_tensor_parallel() -> None:
    """Leave the run (every rank, once its last collective is done). CUDA graphs that captured NCCL collectives
    (the vocabulary-split head's all-gather) are freed first, and the device's work finished: destroying the
    process group while such graphs lived left both ranks waiting in `destroy_process_group` on two GPUs."""
    if dist.is_initialized():
        gc.collect()  # the engine's graph runner sits in reference cycles: collect it (and its graphs) now
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        dist.destroy_process_group()
