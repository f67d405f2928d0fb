"""Kernel time of the engine's graphed step and 32-node tree verification, one GPU and each of two ranks.

Builds the same Qwen3-32B-shaped random model as `gpu_tensor_parallel.py` (1,536 cached positions), runs the graph
runner's forward (what the engine runs) and records 5 replays with torch.profiler (CUDA activity): device time
per forward, kernels per forward and the 14 costliest kernels, beside the wall time (median of 20).

Usage (two GPUs; keep NVLink multicast off):
  NCCL_NVLS_ENABLE=0 PYTHONPATH=src python3 benchmarks/gpu_tensor_parallel_profile.py OUT.json
"""

from __future__ import annotations

import collections
import gc
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).parent))
import gpu_tensor_parallel as bench  # the sibling benchmark (its folder is on the path above)

from dflash.models.model import CausalLM
from dflash.parallel.group import TensorParallel
from dflash.parallel.launch import launch
from dflash.parallel.layers import prepare_sums

CONTEXT = 1536
REPLAYS = 5


def breakdown(fn: Callable[[], object], device: torch.device, tp: TensorParallel | None) -> dict[str, Any]:
    for _ in range(5):
        fn()
    torch.cuda.synchronize(device)
    if tp is not None:
        dist.barrier(group=tp.group)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(REPLAYS):
            fn()
        torch.cuda.synchronize(device)
    time_us: collections.Counter[str] = collections.Counter()
    count: collections.Counter[str] = collections.Counter()
    for event in prof.events():
        if event.device_type.name == "CUDA":
            name = event.name[:60]
            time_us[name] += event.device_time_total
            count[name] += 1
    return {
        "kernel_us_per_step": round(sum(time_us.values()) / REPLAYS, 1),
        "kernels_per_step": sum(count.values()) // REPLAYS,
        "top": [(name, round(t / REPLAYS, 1), count[name] // REPLAYS) for name, t in time_us.most_common(14)],
    }


def profile_model(model: CausalLM, device: torch.device, tp: TensorParallel | None) -> dict[str, Any]:
    calls = bench.runner_forwards(model, CONTEXT)
    out: dict[str, Any] = {}
    with torch.inference_mode():
        for shape in ("step", "tree32"):
            out[shape] = breakdown(calls[shape], device, tp)
            out[shape]["wall_ms"] = bench.median_ms(calls[shape], device, tp)
    return out


def rank(tp: TensorParallel, part: str) -> int:
    model = bench.random_target(bench.qwen3_32b_config(), tp.device, torch.bfloat16, tp, seed=1 + tp.rank)
    prepare_sums(model, tp)
    Path(f"{part}.rank{tp.rank}").write_text(json.dumps(profile_model(model, tp.device, tp)))
    return 0


def main() -> int:
    out = sys.argv[1]
    device = torch.device("cuda", 0)
    model = bench.random_target(bench.qwen3_32b_config(), device, torch.bfloat16, None, seed=0)
    report: dict[str, Any] = {"tp1": profile_model(model, device, None)}
    del model
    gc.collect()
    torch.cuda.empty_cache()
    code = launch(2, rank, out, device_type="cuda")
    for r in range(2):
        report[f"tp2_rank{r}"] = json.loads(Path(f"{out}.rank{r}").read_text())
    Path(out).write_text(json.dumps(report, indent=1))
    return code


if __name__ == "__main__":
    sys.exit(main())
