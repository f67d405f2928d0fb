"""Tensor parallelism on two GPUs: a Qwen3-32B-shaped target with random bf16 weights, one GPU against two.

Measures, in one run, the target forwards decoding runs after ~1.5K cached positions:
* `step`: one new token (a plain decoding step);
* `verify16`: 16 new tokens, causal by position (a linear DFlash verification), 5 layers' features captured;
* `tree32`: a DDTree verification of budget 32 (the root and 32 drafted nodes, 33 rows under an ancestor mask),
  5 layers' features captured;
each the median of 20 timed forwards after warm-up (host timer around the forward, `torch.cuda.synchronize`
before and after; on two GPUs the ranks meet at a barrier before each forward and the slower rank's time counts).
`tp1_*` runs the whole model on GPU 0 in one process; `tp2_*` runs half of it on each GPU, one process each,
through `dflash.parallel` (row-parallel o/down projections, each followed by an all-reduce).

Three ways to run each forward:
* `*_ms` (the headline `tp1_step_ms` / `tp2_step_ms`): what the engine runs, the graph runner's forward
  (`dflash.fastpath.runner.GraphRunner.target_forward`: inputs copied into a captured CUDA graph of the fused layers,
  outputs copied out); on two GPUs with the run's default all-reduce (`DFLASH_TP_ALLREDUCE=auto`: the sums folded
  into the add+RMSNorm over symmetric memory where the GPUs reach each other, `tp2_all_reduce` says which), and
  `tp2_*_<mode>_ms` the same with each other all-reduce (nccl, symmetric: the one-shot all-reduce then the
  add+RMSNorm, fused / oneway: the folded sums with flags / without);
* `*_graph_ms`: the model's own (unfused) forward captured in one CUDA graph, NCCL all-reduces inside;
* `*_eager_ms`: the model's own forward, uncaptured.
Also the latency of one all-reduce of one residual row and of 33 rows, eager (NCCL) and captured (NCCL, symmetric),
and of one folded sum (`folded_graph_<mode>_*_us`, captured, with the add+RMSNorm).

Weights are drawn on each GPU in place (each rank only its shard), so start-up takes seconds. DFlash rounds with
the drafter on another GPU (`--draft-device`): `benchmarks/gpu_draft_device.py`.

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
from gpu_scale_study import random_tree  # benchmarks/ is the script's folder

from dflash.config import ModelConfig
from dflash.environment import variables_set
from dflash.fastpath.runner import MAX_GRAPH_ROWS, GraphRunner
from dflash.kv.cache import KVCache
from dflash.models.model import CausalLM
from dflash.models.registry import MODEL_CLASSES
from dflash.models.rope import Rotary
from dflash.parallel.collectives import FOLDED
from dflash.parallel.group import TensorParallel, multicast_off
from dflash.parallel.launch import launch
from dflash.parallel.layers import prepare_sums
from dflash.parallel.sharding import vocab_split

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
    mask, depth = random_tree(rows)
    return (context + torch.tensor(depth))[None].to(device), mask.to(device)


def shape_inputs(config: ModelConfig, context: int, device: torch.device) -> dict[str, dict[str, Any]]:
    """Token ids, positions (None: after the cache), tree mask and captured layers of each measured shape."""
    vocab = config.vocab_size
    layers = capture_layers(config)
    generator = torch.Generator().manual_seed(1)
    tree_positions, tree_mask = tree_inputs(TREE_BUDGET + 1, context, device)
    return {
        "step": {"ids": torch.randint(0, vocab, (1, 1), generator=generator).to(device), "positions": None,
                 "tree_mask": None, "capture": ()},
        "verify16": {"ids": torch.randint(0, vocab, (1, VERIFY_ROWS), generator=generator).to(device),
                     "positions": None, "tree_mask": None, "capture": layers},
        "tree32": {"ids": torch.randint(0, vocab, (1, TREE_BUDGET + 1), generator=generator).to(device),
                   "positions": tree_positions, "tree_mask": tree_mask, "capture": layers},
    }


def model_forwards(model: CausalLM, cache: KVCache, context: int) -> dict[str, Callable[[], object]]:
    """The model's own forward of each shape; each rewinds the cache to `context` first (the same slots every time)."""
    calls: dict[str, Callable[[], object]] = {}
    for name, inputs in shape_inputs(model.config, context, cache.keys.device).items():

        def call(inputs: dict[str, Any] = inputs) -> object:
            cache.length = context
            return model(inputs["ids"], inputs["positions"], cache, tree_mask=inputs["tree_mask"],
                         capture=inputs["capture"])

        calls[name] = call
    return calls


def runner_forwards(model: CausalLM, context: int) -> dict[str, Callable[[], object]]:
    """The engine's forward of each shape: a fresh graph runner's (fused layers, graphs captured on first use)
    over a leased cache of `context` random positions."""
    runner = GraphRunner(model, None, context + 2 * MAX_GRAPH_ROWS)
    runner.target_storage.keys.normal_()
    runner.target_storage.values.normal_()
    runner.target_storage.positions[0, :context] = torch.arange(context, device=runner.device)
    cache = runner.lease_target_cache(context + MAX_GRAPH_ROWS)
    assert cache is not None
    calls: dict[str, Callable[[], object]] = {}
    for name, inputs in shape_inputs(model.config, context, runner.device).items():

        def call(inputs: dict[str, Any] = inputs) -> object:
            cache.length = context
            out = runner.target_forward(
                inputs["ids"], inputs["positions"], cache, inputs["tree_mask"], inputs["capture"], "all"
            )
            assert out is not None, "not a graph shape"
            return out

        calls[name] = call
    calls["_runner"] = lambda: runner  # kept alive with the calls
    return calls


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
    kinds: tuple[str, ...],
) -> dict[str, Any]:
    """`kinds` of forwards timed per shape: "eager", "graph" (the model's forward in one graph), "engine" (the graph
    runner's) -> {prefix_shape[_kind]_ms: median ms}; a failing kind is reported and the others still come back."""
    out: dict[str, Any] = {}
    for kind in kinds:
        try:
            with torch.inference_mode():
                calls = runner_forwards(model, context) if kind == "engine" else model_forwards(model, cache, context)
            suffix = "" if kind == "engine" else f"_{kind}"
            for name, fn in calls.items():
                if name.startswith("_"):
                    continue
                out[f"{prefix}_{name}{suffix}_ms"] = median_ms(as_graph(fn, device) if kind == "graph" else fn, device, tp)
        except Exception as exc:
            out[f"{prefix}_{kind}_error"] = f"{type(exc).__name__}: {exc}"[:500]
        gc.collect()
    return out


def all_reduce_us(
    config: ModelConfig, dtype: torch.dtype, tp: TensorParallel, rows: int, *, graph: bool = False
) -> float:
    """Median microseconds of one all-reduce of `rows` residual rows (100 back to back, per call) through the
    run's `PartialSums` in its current mode; `graph`: the hundred captured in one CUDA graph."""
    data = torch.zeros(rows, config.hidden_size, dtype=dtype, device=tp.device)

    def hundred() -> None:
        for _ in range(100):
            tp.sums(data)

    fn = as_graph(hundred, tp.device) if graph else hundred
    return round(median_ms(fn, tp.device, tp, iters=10, warmup=2) * 10, 3)  # ms per 100 -> us per call


def folded_sum_us(config: ModelConfig, dtype: torch.dtype, tp: TensorParallel, rows: int) -> float:
    """Median microseconds of one sum folded into the add+RMSNorm (the run's current folded mode), 100 back to back
    in one CUDA graph, alternating regions as the fused forward does."""
    partial = torch.zeros(rows, config.hidden_size, dtype=dtype, device=tp.device)
    weight = torch.ones(config.hidden_size, dtype=dtype, device=tp.device)

    def hundred() -> None:
        stream = partial
        for call in range(100):
            _, stream = tp.sums.add_rms_norm(partial, stream, weight, 1e-6, call % 2)

    return round(median_ms(as_graph(hundred, tp.device), tp.device, tp, iters=10, warmup=2) * 10, 3)


# ---- the two phases -------------------------------------------------------------------------------------------
def run_tp1(config: ModelConfig, device: torch.device, dtype: torch.dtype, context: int) -> dict[str, Any]:
    started = time.perf_counter()
    model = random_target(config, device, dtype, None, seed=0)
    built = time.perf_counter() - started
    cache = filled_cache(model, context + 64, context)
    kinds = ("engine", "graph", "eager") if device.type == "cuda" else ("engine", "eager")
    out = measure(model, cache, context, device, None, "tp1", kinds)
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
    default_mode = prepare_sums(model, tp)
    out: dict[str, Any] = {
        "tp2_build_s": round(time.perf_counter() - started, 2), "tp2_all_reduce": default_mode,
        "tp2_vocab_split": vocab_split(config, tp.world),  # DFLASH_TP_VOCAB_SPLIT: embeddings and head split
    }
    cache = filled_cache(model, context + 64, context)
    out["tp2_kv_heads_per_rank"] = int(cache.keys.shape[2])
    tp.sums.use("nccl")
    out["allreduce_1row_us"] = all_reduce_us(config, dtype, tp, 1)
    out["allreduce_33rows_us"] = all_reduce_us(config, dtype, tp, TREE_BUDGET + 1)
    out.update(measure(model, cache, context, tp.device, tp, "tp2", ("eager",)))
    _save_part(tp, payload, out)  # the eager figures are safe before graph capture is tried
    if tp.device.type == "cuda":
        for mode in dict.fromkeys(("nccl", "symmetric" if default_mode in FOLDED else default_mode)):
            tp.sums.use(mode)
            out[f"allreduce_graph_{mode}_1row_us"] = all_reduce_us(config, dtype, tp, 1, graph=True)
            out[f"allreduce_graph_{mode}_33rows_us"] = all_reduce_us(config, dtype, tp, TREE_BUDGET + 1, graph=True)
        for mode in FOLDED if default_mode in FOLDED else ():
            tp.sums.use(mode)
            out[f"folded_graph_{mode}_1row_us"] = folded_sum_us(config, dtype, tp, 1)
            out[f"folded_graph_{mode}_33rows_us"] = folded_sum_us(config, dtype, tp, TREE_BUDGET + 1)
        tp.sums.use("nccl")
        out.update(measure(model, cache, context, tp.device, tp, "tp2", ("graph",)))
        others = ("nccl", "symmetric", *FOLDED) if default_mode in FOLDED else ("nccl",)
        others = tuple(mode for mode in others if mode != default_mode)
        for mode in others:  # the engine with the other all-reduces, for comparison
            tp.sums.use(mode)
            timed = measure(model, cache, context, tp.device, tp, "tp2", ("engine",))
            out.update({key.replace("_ms", f"_{mode}_ms").replace("_error", f"_{mode}_error"): v
                        for key, v in timed.items()})
            _save_part(tp, payload, out)
    tp.sums.use(default_mode)
    out.update(measure(model, cache, context, tp.device, tp, "tp2", ("engine",)))
    if tp.device.type == "cuda":
        out["tp2_peak_gib"] = round(torch.cuda.max_memory_allocated(tp.device) / 2**30, 2)
    _save_part(tp, payload, out)
    return 0


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
        for kind in ("", "_graph", "_eager"):
            one, two = out.get(f"tp1_{shape}{kind}_ms"), out.get(f"tp2_{shape}{kind}_ms")
            if one and two:
                found[f"tp2_over_tp1_{shape}{kind}"] = round(two / one, 3)
        for mode in ("nccl", "symmetric", *FOLDED):
            one, two = out.get(f"tp1_{shape}_ms"), out.get(f"tp2_{shape}_{mode}_ms")
            if one and two:
                found[f"tp2_{mode}_over_tp1_{shape}"] = round(two / one, 3)
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
        "variables": variables_set(),
        "notes": "*_ms: the engine's forward (the graph runner: fused layers in captured CUDA graphs, all-reduces "
                 "inside; tp2 with the run's default all-reduce, tp2_all_reduce); tp2_*_<mode>_ms: the same with "
                 "another all-reduce (nccl; symmetric: one-shot then add+RMSNorm; fused / oneway: folded into the "
                 "add+RMSNorm, with flags / without); *_graph_ms: the model's unfused forward in one CUDA graph "
                 "(NCCL); *_eager_ms: uncaptured. folded_graph_<mode>_*_us: one folded sum, 100 in a graph. "
                 "tp2_vocab_split: embeddings and LM head split by vocabulary rows.",
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
