"""`--tensor-parallel N` for `dflash serve` and `dflash generate`: the command runs on N ranks.

Each rank loads its share of the target and a whole drafter (`dflash.engine.loading.load_engine`); the first rank
runs the command itself (`leader_main`, with a `LeaderEngine` in place of the engine) and the others follow it
until it is done (`dflash.parallel.spmd`).
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable
from typing import Any

from dflash.errors import DFlashError
from dflash.parallel.group import TensorParallel

LeaderMain = Callable[[Any, argparse.Namespace], int]


def add_tensor_parallel_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--tensor-parallel", type=int, default=1, metavar="N",
        help="split the target across N GPUs (cuda:0..N-1), one process each over NCCL (--device cpu: N CPU "
        "processes over gloo); the heads, key/value heads and MLP width must divide by N. Each GPU holds a whole "
        "drafter. Runs dense weights; on GPUs each rank replays CUDA graphs with the all-reduces inside "
        "(DFLASH_TP_ALLREDUCE=auto|nccl|symmetric|fused|oneway) (default 1: one device)",
    )


def tensor_parallel_size(args: argparse.Namespace) -> int:
    size = int(getattr(args, "tensor_parallel", 1))
    if size < 1:
        raise DFlashError(f"--tensor-parallel must be at least 1, got {size}")
    return size


def run_ranks(args: argparse.Namespace, leader_main: LeaderMain) -> int:
    """Run `leader_main(engine, args)` on the first of --tensor-parallel ranks (a module-level function)."""
    from dflash.parallel.launch import launch

    device_type = "cpu" if str(args.device) == "cpu" else "cuda"
    if device_type == "cuda" and str(args.device) not in ("auto", "cuda"):
        raise DFlashError(f"--tensor-parallel uses cuda:0..N-1; give --device cuda or auto, not {args.device}")
    level = logging.INFO if getattr(args, "verbose", False) else logging.WARNING
    return launch(tensor_parallel_size(args), _rank_entry, (args, leader_main), device_type=device_type,
                  log_level=level)


def _rank_entry(tensor_parallel: TensorParallel, payload: tuple[argparse.Namespace, LeaderMain]) -> int:
    from dflash.cli.common import engine_from_args
    from dflash.parallel.spmd import LeaderEngine, follow, join_engine

    args, leader_main = payload
    engine = engine_from_args(args, tensor_parallel=tensor_parallel)
    agreement = join_engine(engine, tensor_parallel)
    if not tensor_parallel.leader:
        follow(engine, agreement)
        return 0
    leader = LeaderEngine(engine, agreement)
    try:
        return leader_main(leader, args)
    finally:
        leader.close()
