"""Starting the ranks of a tensor-parallel run: one spawned process per device, joined by torch.distributed.

`launch(world, entry, payload)` picks a free rendezvous port, keeps NVLink multicast off, spawns `world` processes
(torch.multiprocessing, start method spawn) and runs `entry(tensor_parallel, payload)` in each once its process
groups exist. The calling process only waits: the first rank serves, the others follow it. Ctrl-C reaches the first
rank alone (the others ignore it and end when the first releases them), and the parent keeps waiting for them;
SIGTERM to the parent is passed to the first rank as Ctrl-C.
If a rank fails, torch ends the others and the launch returns that rank's exit status.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.multiprocessing as mp

from dflash.errors import DFlashError
from dflash.parallel.group import TensorParallel, multicast_off, start_tensor_parallel, stop_tensor_parallel

__all__ = ["free_port", "launch"]

RankEntry = Callable[[TensorParallel, Any], int]


def free_port() -> int:
    """A TCP port of the loopback interface that nothing listens on now (the rendezvous of the ranks)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def launch(
    world: int,
    entry: RankEntry,
    payload: Any,
    *,
    device_type: str = "cuda",
    log_level: int = logging.WARNING,
    timeout: timedelta | None = None,
) -> int:
    """Run `entry(tensor_parallel, payload)` on `world` ranks; returns 0, or the exit status of a failed rank
    (128 + the signal that ended it). `entry` and `payload` must pickle (a module-level function; plain data).
    `timeout` bounds every collective (`start_tensor_parallel`)."""
    if world < 2:
        raise DFlashError(f"tensor parallelism needs at least 2 ranks, got {world}")
    multicast_off()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(free_port())
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # inherited by the ranks; the first restores it
    previous_term = signal.getsignal(signal.SIGTERM)
    try:
        context = mp.start_processes(
            _rank_main, args=(world, device_type, entry, payload, log_level, timeout), nprocs=world, join=False,
            start_method="spawn",
        )
        first = context.processes[0].pid
        # a termination request (a service manager's stop) ends the run as Ctrl-C does: through the first rank
        signal.signal(signal.SIGTERM, lambda _signum, _frame: os.kill(first, signal.SIGINT) if first else None)
        try:
            while not context.join():
                pass
        except mp.ProcessExitedException as exc:
            code = exc.exit_code or 1
            return code if code > 0 else 128 - code  # a negative code is the signal that ended the rank
        except mp.ProcessRaisedException as exc:
            print(str(exc), file=sys.stderr)
            return 1
        return 0
    finally:
        signal.signal(signal.SIGINT, previous)
        signal.signal(signal.SIGTERM, previous_term)


def _rank_main(
    rank: int, world: int, device_type: str, entry: RankEntry, payload: Any, log_level: int, timeout: timedelta | None
) -> None:
    if rank == 0:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    logging.basicConfig(level=log_level, format=f"%(levelname)s rank{rank} %(name)s: %(message)s")
    try:
        tensor_parallel = start_tensor_parallel(rank, world, device_type, timeout)
        try:
            code = entry(tensor_parallel, payload)
        finally:
            stop_tensor_parallel()
    except DFlashError as exc:
        print(f"error (rank {rank}): {exc}", file=sys.stderr, flush=True)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)
    if code:
        sys.exit(code)
