"""Tensor parallelism on two GPUs: a Qwen3-32B-shaped target with random bf16 weights, one GPU against two.

Measures, in one run, the target forwards decoding runs after ~1.5K cached positions:
* `step`: one new token (a plain decoding step);
* `verify16`: 16 new tokens, causal by position (a linear DFlash verification), 5 layers' features captured;
* `tree32`: a DDTree verification of budget 32 (the root and 32 drafted nodes, 33 rows under an ancestor mask),
  5 layers' features captured;
each the median of 20 timed forwards after warm-up (host timer around the forward, `torch.cuda.synchronize`
before and after; on two GPUs the ranks meet at a barrier before each forward and the slower rank's time counts).
`tp1_*` runs the whole model on GPU 0 in one process; `tp2_*` runs half of it on each GPU, one process each,
through `dflash.parallel` (row-parallel o/down projections with an NCCL all-reduce each). Both run the eager
forwards the engine runs under tensor parallelism (`*_ms`) and the same forwards captured in a CUDA graph
(`*_graph_ms`; on two GPUs the graph holds the NCCL all-reduces), which is what graphs across the collective
would give. Also the latency of the all-reduce of one residual row and of 33 rows.

Weights are drawn on each GPU in place (each rank only its shard), so start-up takes seconds. Not measured: DFlash
rounds with the drafter on another GPU (no `--draft-device` yet).

Usage (on a machine with two GPUs; keep NVLink multicast off):
  NCCL_NVLS_ENABLE=0 PYTHONPATH=src python3 benchmarks/gpu_tensor_parallel.py --out results/gpu_tensor_parallel_h100.json
  PYTHONPATH=src python benchmarks/gpu_tensor_parallel.py --tiny --device cpu --out /tmp/tp.json  (logic check, gloo)
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dflash.config import ModelConfig
from dflash.kv.cache import KVCache
from dflash.models.model import CausalLM
from dflash.models.registry import MODEL_CLASSES
from dflash.models.rope import Rotary
from dflash.parallel.group import TensorParallel, multicast_off
from dflash.parallel.launch import launch

WORLD = 2
ITERS, WARMUP = 20, 3
TREE_BUDGET = 32
VERIFY_ROWS = 16
# collectives give up after this (a hung rank then fails the run instead of holding it to the time limit)
COLLECTIVE_TIMEOUT = timedelta(seconds=180)


def qwen3_32b_config() -> ModelConfig:
    return ModelConfig(
        architecture="qwen3", vocab_size=151936, hidden_size=5120, intermediate_size=25600, num_layers=64,
        num_heads=64, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1_000_000.0,
        max_position_embeddings=40960, tie_word_embeddings=False, layer_types=("full_attention",) * 64, qk_norm=True,
    )


def tiny_config() -> ModelConfig:
    return ModelConfig(
        architecture="qwen3", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=6, num_heads=4,
        num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=512,
        tie_word_embeddings=False, layer_types=("full_attention",) * 6, qk_norm=True,
    )


# ---- models ---------------------------------------------------------------------------------------------------
def random_target(
    config: ModelConfig, device: torch.device, dtype: torch.dtype, tp: TensorParallel | None, seed: int
) -> CausalLM:
    """The model (this rank's shard under `tp`) with N(0, 0.02) matrices and unit norms, drawn on `device`."""
    with torch.device("meta"):
        model = MODEL_CLASSES[config.architecture](config, tp)
    model = model.to(dtype).to_empty(device=device)  # in the target dtype from the start: no float32 copy
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.02, generator=generator)
            else:
                param.fill_(1.0)
        for module in model.modules():
            if isinstance(module, Rotary):
                module.recompute()
    return model.eval().requires_grad_(False)


def filled_cache(model: CausalLM, capacity: int, context: int) -> KVCache:
    cache = model.new_cache(capacity)  # this rank's key/value heads
    cache.keys.normal_()
    cache.values.normal_()
    cache.positions[0, :context] = torch.arange(context, device=cache.positions.device)
    cache.length = context
    return cache


def capture_layers(config: ModelConfig) -> tuple[int, ...]:
    """Five layers spread over the depth, as a DFlash drafter reads them."""
    return tuple(sorted({1 + i * (config.num_layers - 3) // 4 for i in range(5)}))


def tree_inputs(rows: int, context: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A random tree of `rows` rows (root first, each node's parent before it): positions [1, rows] (context +
    depth) and the ancestor-or-self mask [rows, rows]."""
    generator = torch.Generator().manual_seed(0)
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=generator)) for i in range(1, rows)]
    depth = [0] * rows
    mask = torch.zeros(rows, rows, dtype=torch.bool)
    for node in range(rows):
        walk = node
        while walk >= 0:
            mask[node, walk] = True
            walk = parents[walk]
        depth[node] = 0 if parents[node] < 0 else depth[parents[node]] + 1
    return (context + torch.tensor(depth))[None].to(device), mask.to(device)


def forwards(model: CausalLM, cache: KVCache, context: int) -> dict[str, Callable[[], object]]:
    """The measured forwards; each rewinds the cache to `context` first (the same slots every time)."""
    device = cache.keys.device
    vocab = model.config.vocab_size
    layers = capture_layers(model.config)
    generator = torch.Generator().manual_seed(1)
    step_ids = torch.randint(0, vocab, (1, 1), generator=generator).to(device)
    verify_ids = torch.randint(0, vocab, (1, VERIFY_ROWS), generator=generator).to(device)
    tree_ids = torch.randint(0, vocab, (1, TREE_BUDGET + 1), generator=generator).to(device)
    tree_positions, tree_mask = tree_inputs(TREE_BUDGET + 1, context, device)

    def step() -> object:
        cache.length = context
        return model(step_ids, cache=cache)

    def verify16() -> object:
        cache.length = context
        return model(verify_ids, cache=cache, capture=layers)

    def tree32() -> object:
        cache.length = context
        return model(tree_ids, tree_positions, cache, tree_mask=tree_mask, capture=layers)

    return {"step": step, "verify16": verify16, "tree32": tree32}


# ---- timing ---------------------------------------------------------------------------------------------------
def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(
    fn: Callable[[], object], device: torch.device, tp: TensorParallel | None, iters: int = ITERS,
    warmup: int = WARMUP,
) -> float:
    """Median over `iters` calls of the wall time of `fn` on the device; under `tp` the ranks start each call
    together (barrier) and the slowest rank's time counts."""
    with torch.inference_mode():
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(iters):
            synchronize(device)
            if tp is not None:
                dist.barrier(group=tp.group)
                synchronize(device)
            started = time.perf_counter()
            fn()
            synchronize(device)
            times.append((time.perf_counter() - started) * 1e3)
    spread = torch.tensor(times, dtype=torch.float64, device=device)
    if tp is not None:
        dist.all_reduce(spread, op=dist.ReduceOp.MAX, group=tp.group)
    return round(statistics.median(spread.tolist()), 4)


def as_graph(fn: Callable[[], object], device: torch.device) -> Callable[[], object]:
    """`fn` captured in a CUDA graph after warm-up on a side stream; returns the replay."""
    with torch.inference_mode():
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(3):
                fn()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
    return graph.replay


def measure(
    model: CausalLM, cache: KVCache, context: int, device: torch.device, tp: TensorParallel | None, prefix: str,
    graphs: bool,
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    calls = forwards(model, cache, context)
    for name, fn in calls.items():
        out[f"{prefix}_{name}_ms"] = median_ms(fn, device, tp)
    if graphs:
        for name, fn in calls.items():
            try:
                out[f"{prefix}_{name}_graph_ms"] = median_ms(as_graph(fn, device), device, tp)
            except Exception as exc:  # reported, and the eager figures still come back
                out[f"{prefix}_graph_error"] = f"{type(exc).__name__}: {exc}"[:500]
                break
    return out


def all_reduce_us(config: ModelConfig, dtype: torch.dtype, tp: TensorParallel, rows: int) -> float:
    """Median microseconds of one all-reduce of `rows` residual rows (100 back to back, per call)."""
    data = torch.zeros(rows, config.hidden_size, dtype=dtype, device=tp.device)

    def hundred() -> None:
        for _ in range(100):
            dist.all_reduce(data, group=tp.group)

    return round(median_ms(hundred, tp.device, tp, iters=10, warmup=2) * 10, 3)  # ms per 100 -> us per call


# ---- the two phases -------------------------------------------------------------------------------------------
def run_tp1(config: ModelConfig, device: torch.device, dtype: torch.dtype, context: int) -> dict[str, Any]:
    started = time.perf_counter()
    model = random_target(config, device, dtype, None, seed=0)
    built = time.perf_counter() - started
    cache = filled_cache(model, context + 64, context)
    out = measure(model, cache, context, device, None, "tp1", graphs=device.type == "cuda")
    out["tp1_build_s"] = round(built, 2)
    if device.type == "cuda":
        out["tp1_peak_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
    del model, cache
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()  # GPU 0 must hold a rank's half next
        out["tp1_left_gib"] = round(torch.cuda.memory_allocated(device) / 2**30, 2)
    return out


def tp2_rank(tp: TensorParallel, payload: dict[str, Any]) -> int:
    """One rank of the two-GPU phase; the first writes what both measured to payload["part"]."""
    config = tiny_config() if payload["tiny"] else qwen3_32b_config()
    dtype = getattr(torch, payload["dtype"])
    context = payload["context"]
    if tp.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(tp.device)
    started = time.perf_counter()
    model = random_target(config, tp.device, dtype, tp, seed=1 + tp.rank)
    out: dict[str, Any] = {"tp2_build_s": round(time.perf_counter() - started, 2)}
    cache = filled_cache(model, context + 64, context)
    out["tp2_kv_heads_per_rank"] = int(cache.keys.shape[2])
    out.update(measure(model, cache, context, tp.device, tp, "tp2", graphs=False))
    out["allreduce_1row_us"] = all_reduce_us(config, dtype, tp, 1)
    out["allreduce_33rows_us"] = all_reduce_us(config, dtype, tp, TREE_BUDGET + 1)
    _save_part(tp, payload, out)  # the eager figures are safe before graph capture is tried
    if tp.device.type == "cuda":
        out.update(measure_graphs_only(model, cache, context, tp))
        out["tp2_peak_gib"] = round(torch.cuda.max_memory_allocated(tp.device) / 2**30, 2)
        _save_part(tp, payload, out)
    return 0


def measure_graphs_only(model: CausalLM, cache: KVCache, context: int, tp: TensorParallel) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, fn in forwards(model, cache, context).items():
        try:
            out[f"tp2_{name}_graph_ms"] = median_ms(as_graph(fn, tp.device), tp.device, tp)
        except Exception as exc:
            out["tp2_graph_error"] = f"{type(exc).__name__}: {exc}"[:500]
            break
    return out


def _save_part(tp: TensorParallel, payload: dict[str, Any], out: dict[str, Any]) -> None:
    if tp.leader:
        Path(payload["part"]).write_text(json.dumps(out))


# ---- report ---------------------------------------------------------------------------------------------------
def environment(device_type: str) -> dict[str, Any]:
    env: dict[str, Any] = {
        "torch": torch.__version__, "python": platform.python_version(), "host": platform.node(),
    }
    if device_type == "cuda":
        env["cuda"] = torch.version.cuda
        env["nccl"] = ".".join(str(v) for v in torch.cuda.nccl.version())
        env["devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return env


def ratios(out: dict[str, Any]) -> dict[str, float]:
    found = {}
    for shape in ("step", "verify16", "tree32"):
        for kind in ("", "_graph"):
            one, two = out.get(f"tp1_{shape}{kind}_ms"), out.get(f"tp2_{shape}{kind}_ms")
            if one and two:
                found[f"tp2_over_tp1_{shape}{kind}"] = round(two / one, 3)
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--tiny", action="store_true", help="a 6-layer toy shape (checks the script's logic)")
    parser.add_argument("--context", type=int, default=1536, help="cached positions before each forward")
    parser.add_argument("--skip-tp1", action="store_true", help="only the two-GPU phase")
    args = parser.parse_args()
    multicast_off()
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    config = tiny_config() if args.tiny else qwen3_32b_config()
    context = min(args.context, 128) if args.tiny else args.context
    out_path = Path(args.out)
    report: dict[str, Any] = {
        "benchmark": "gpu_tensor_parallel",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "shape": {
            "hidden": config.hidden_size, "layers": config.num_layers, "heads": config.num_heads,
            "kv_heads": config.num_kv_heads, "head_dim": config.head_dim, "intermediate": config.intermediate_size,
            "vocab": config.vocab_size, "dtype": str(dtype).removeprefix("torch."),
        },
        "context": context, "iters": ITERS, "verify_rows": VERIFY_ROWS, "tree_rows": TREE_BUDGET + 1,
        "capture_layers": list(capture_layers(config)),
        "environment": environment(args.device),
        "notes": "*_ms: eager forwards (what the engine runs under tensor parallelism); *_graph_ms: the same "
                 "forward replayed from a CUDA graph (two GPUs: NCCL all-reduces inside the graph). Embeddings and "
                 "LM head replicated on both GPUs. DFlash rounds with the drafter on the second GPU: not measured "
                 "(no --draft-device yet).",
    }

    def save() -> None:
        report["ratios"] = ratios(report)
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(report, indent=2) + "\n")

    if not args.skip_tp1:
        report.update(run_tp1(config, device, dtype, context))
        save()
        print(json.dumps({k: v for k, v in report.items() if k.startswith("tp1")}), flush=True)
    part = out_path.with_name(out_path.name + ".tp2.json")
    payload = {"tiny": args.tiny, "dtype": str(dtype).removeprefix("torch."), "context": context, "part": str(part)}
    code = launch(WORLD, tp2_rank, payload, device_type=args.device, timeout=COLLECTIVE_TIMEOUT)
    if part.is_file():
        report.update(json.loads(part.read_text()))
        part.unlink()
    if code:
        report["tp2_error"] = f"a rank exited with status {code}"
    save()
    print(json.dumps({k: v for k, v in report.items() if k.startswith(("tp2", "allreduce", "ratios"))}), flush=True)
    return 0 if code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
