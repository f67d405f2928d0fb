"""Where the engine loop's time goes while `dflash bench concurrency` runs, per closed loop (level and mode).

Wraps the batched core's phases (admission, planning, device rounds launched and read, commits, prompt passes,
host copies' waits) with exclusive wall-clock timers on the engine loop's thread (a phase's figure leaves out the
phases inside it), and on CUDA records events around every launched device round and plain step, prompt pass,
host-built step's pass and drafter context write, so each one's GPU time can be set against the host's. `event.synchronize (wait)` is the time the host waited for the
GPU: large there, the loop is bound by the GPU; small, by the host. The timers cost some host time themselves, so
the levels' tokens/s here are not the benchmark's.

Usage: python benchmarks/engine_loop_trace.py OUT.json -- <dflash bench concurrency arguments>
e.g. ... -- --model M.gguf --draft default --modes ar,ddtree --concurrency 8,8 --requests 64 --max-tokens 128 --json
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from batch_host_overhead import Timers  # benchmarks/ is the script's folder

from dflash.batch import context_store as context_module
from dflash.batch import core as core_module
from dflash.batch import device_trees as trees_module
from dflash.batch import graphs as graphs_module
from dflash.batch import loop as loop_module
from dflash.batch import overlap as overlap_module
from dflash.batch import padded as padded_module
from dflash.bench import concurrency as concurrency_module

CUDA = torch.cuda.is_available()


TIMERS = Timers()  # timing the engine loop's thread only (set as it starts)
LAUNCHES: list[tuple[str, Any, Any]] = []  # (round shape, start event, end event)
LEVELS: list[dict[str, Any]] = []

PHASES: list[tuple[Any, str, str]] = [
    (core_module.BatchCore, "step", "step (rest)"),
    (core_module.BatchCore, "_admit", "admit"),
    (core_module.BatchCore, "_follow_device_round", "follow (rest)"),
    (core_module.BatchCore, "_plan_rounds", "plan rounds"),
    (core_module.BatchCore, "_tree_option", "tree option"),
    (core_module.BatchCore, "_commit_device_round", "commit device round (rest)"),
    (core_module.BatchCore, "_after_device_round", "after device round (rest)"),
    (core_module.BatchCore, "_commit", "commit (sink)"),
    (core_module.BatchCore, "_prefill_alone", "prompt pass beside a round (rest)"),
    (core_module.BatchCore, "_target_pass", "target pass (rest)"),
    (core_module.BatchCore, "_after_prefill", "after prefill (rest)"),
    (core_module.BatchCore, "_absorb_prompt", "after prefill: absorb prompt context"),
    (core_module.BatchCore, "_overlapped_step", "overlapped plain step (rest)"),
    (core_module.BatchCore, "_commit_launched", "commit plain step (rest)"),
    (core_module.BatchCore, "_device_tree_step", "device round from the host (rest)"),
    (trees_module.DeviceTrees, "launch", "device round launch (rest)"),
    (trees_module.DeviceTrees, "read", "device round read (rest)"),
    (trees_module.DeviceTrees, "_load", "device round load (rest)"),
    (trees_module, "absorb_context_rows", "device round load: absorb context"),
    (overlap_module.OverlappedSteps, "launch", "plain step launch (rest)"),
    (padded_module.PaddedBatch, "load", "padded batch load"),
    (graphs_module.GraphedTargetPasses, "prefill", "prompt graphs (rest)"),
    (graphs_module.PaddedGraphs, "ensure", "graph captures"),
    (loop_module.BatchLoop, "_observe", "observe"),
    (loop_module.BatchLoop, "_run_alone", "single-request path"),
    (torch.cuda.Event, "synchronize", "event.synchronize (wait)"),
    (torch.cuda.CUDAGraph, "replay", "graph replay"),
]


def with_events(label: Callable[[Any, Any], str], fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` (a launch) between two CUDA events, kept under `label(self, result)`."""

    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not CUDA:
            return fn(self, *args, **kwargs)
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        result = fn(self, *args, **kwargs)
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        LAUNCHES.append((label(self, args), start, end))
        return result

    return run


def _rows_bucket(items: Any, *, features: bool = False) -> int:
    """The summed rows of a pass's items, rounded up to a power of two (a label, not a shape)."""
    rows = sum(int(item.new_features.shape[0]) if features else int(item.count) for item in items)
    return 1 << max(0, (rows - 1).bit_length())


def instrument() -> None:
    for owner, name, label in PHASES:
        setattr(owner, name, TIMERS.wrap(label, getattr(owner, name)))
    trees = trees_module.DeviceTrees
    trees.launch = with_events(  # type: ignore[method-assign]
        lambda self, args: f"tree r{self.launched.shape.requests} b{args[1]} k{self.launched.shape.keys}", trees.launch
    )
    steps = overlap_module.OverlappedSteps
    steps.launch = with_events(lambda self, args: f"plain n{len(args[0])}", steps.launch)  # type: ignore[method-assign]
    # prompt passes (graphed up to a few requests, else packed) and the drafter context writes beside the rounds
    passes = graphs_module.GraphedTargetPasses
    passes.prefill = with_events(  # type: ignore[method-assign]
        lambda self, args: f"prompt n{len(args[0])} rows{_rows_bucket(args[0])}", passes.prefill
    )
    passes.run = with_events(lambda self, args: f"host-built step n{len(args[0])}", passes.run)  # type: ignore[method-assign]
    run_target = core_module.run_target  # (target, pool, items, ...): host-built steps' packed passes

    def packed(_: Any, *args: Any, **kwargs: Any) -> Any:
        return run_target(*args, **kwargs)

    timed_packed = with_events(lambda _, args: f"packed pass n{len(args[2])}", packed)
    core_module.run_target = lambda *args, **kwargs: timed_packed(None, *args, **kwargs)  # type: ignore[assignment]
    stores = context_module.ContextStores
    stores.absorb = with_events(  # type: ignore[method-assign]
        lambda self, args: f"context store rows{_rows_bucket(args[0], features=True)}", stores.absorb
    )
    loop = loop_module.BatchLoop._loop

    def traced_loop(self: Any) -> None:
        TIMERS.thread = threading.get_ident()
        loop(self)

    loop_module.BatchLoop._loop = traced_loop  # type: ignore[method-assign]
    closed_loop = concurrency_module.closed_loop

    def traced_closed_loop(generator: Any, prompts: Any, **kwargs: Any) -> Any:
        if CUDA:
            torch.cuda.synchronize()
        TIMERS.reset()
        LAUNCHES.clear()
        started = time.perf_counter()
        run = closed_loop(generator, prompts, **kwargs)
        wall = time.perf_counter() - started
        if CUDA:
            torch.cuda.synchronize()
        gpu: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
        for label, start, end in LAUNCHES:
            gpu[label][0] += 1
            gpu[label][1] += start.elapsed_time(end)
        LEVELS.append({
            "spec": kwargs["spec"], "clients": kwargs["clients"], "requests": kwargs["requests"],
            "wall_ms": round(wall * 1e3, 1), "tokens": sum(t.tokens for t in run.requests),
            "host_ms": {k: [TIMERS.calls[k], round(v * 1e3, 1)]
                        for k, v in sorted(TIMERS.totals.items(), key=lambda item: -item[1])},
            "gpu_ms": {k: [int(v[0]), round(v[1], 1)] for k, v in sorted(gpu.items(), key=lambda item: -item[1][1])},
            "gpu_total_ms": round(sum(v[1] for v in gpu.values()), 1),
        })
        return run

    concurrency_module.closed_loop = traced_closed_loop  # type: ignore[assignment]


def main() -> int:
    if "--" not in sys.argv[1:] or sys.argv[1] == "--":
        print(__doc__)
        return 2
    out = sys.argv[1]
    instrument()
    from dflash.cli import main as dflash_main

    try:
        return dflash_main(["bench", "concurrency", *sys.argv[sys.argv.index("--") + 1:]])
    finally:
        with open(out, "w") as handle:
            json.dump(LEVELS, handle, indent=1)


if __name__ == "__main__":
    sys.exit(main())
