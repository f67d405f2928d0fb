"""Skinny products against cuBLAS on a model's weight shapes (random bf16, built on the GPU).

For each matrix kind of the target (q/k/v, output, gate/up, down: one distinct copy per layer, so a Qwen3-8B's stay
out of L2; the LM head once) and for each row count, replays a CUDA graph of the chain of products over all copies, through
`F.linear` (cuBLAS) and through `dflash.kernels.triton_skinny.skinny_linear` at each configuration of a small grid,
each checked against cuBLAS first. Prints the bandwidth of every chain and the full weight chain (all kinds, the
best configuration per kind) beside cuBLAS's, and writes the figures as JSON. With `--weights int8` the program
reads int8 rows with one float32 scale each (`dflash.models.int8_linear`; cuBLAS still multiplies the bf16 matrices,
and each configuration is checked against the widened int8 matrix).

Usage: python benchmarks/gpu_skinny_gemm.py [--shape smollm2-135m] [--weights int8] --out results/gpu_skinny_gemm_h100.json
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import platform
import statistics
from collections.abc import Callable

import torch
import torch.nn.functional as F

from dflash.kernels.triton_skinny import SkinnyConfig, gpu_model, skinny_config, skinny_linear, skinny_usable
from dflash.models.int8_linear import int8_rows

DTYPE = torch.bfloat16
SHAPES = {  # model -> matrix kind -> (N, K, copies)
    "qwen3-8b": {
        "qkv": (6144, 4096, 36), "o": (4096, 4096, 36), "gate_up": (24576, 4096, 36), "down": (4096, 12288, 36),
        "head": (151936, 4096, 1),
    },
    "qwen3-8b-drafter": {  # the published DFlash drafter of Qwen3-8B: 5 layers, fc from 5 target layers, 32K shortlist
        "fc": (4096, 20480, 1), "qkv": (6144, 4096, 5), "o": (4096, 4096, 5), "gate_up": (24576, 4096, 5),
        "down": (4096, 12288, 5), "head": (32768, 4096, 1),
    },
    "qwen3-32b": {  # eight copies of each layer matrix: enough to stay out of L2 (the whole model is 64 layers)
        "qkv": (10240, 5120, 8), "o": (5120, 8192, 8), "gate_up": (51200, 5120, 8), "down": (5120, 25600, 8),
        "head": (151936, 5120, 1),
    },
    "qwen3-32b-tp2": {  # one rank's share under two-way tensor parallelism (heads, MLP width and vocabulary halved)
        "qkv": (5120, 5120, 8), "o": (5120, 4096, 8), "gate_up": (25600, 5120, 8), "down": (5120, 12800, 8),
        "head": (75968, 5120, 1),
    },
    "smollm2-135m": {
        "qkv": (960, 576, 30), "o": (576, 576, 30), "gate_up": (3072, 576, 30), "down": (576, 1536, 30),
        "head": (49152, 576, 1),
    },
}


def graph_ms(fn: Callable[[], object], iters: int = 15) -> float:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def config_grid(rows: int, tensor_core_tiles: list[tuple[int, ...]]) -> list[SkinnyConfig]:
    grid = [
        SkinnyConfig(block_n, block_k, warps, stages, True)
        for block_n, block_k, warps, stages in itertools.product(*tensor_core_tiles)
    ]
    if rows == 1:
        grid += [
            SkinnyConfig(block_n, block_k, warps, stages, False)
            for block_n, block_k, warps, stages in itertools.product((4, 8, 16, 32), (512, 1024, 2048), (4, 8, 16), (1, 2))
        ]
    return grid


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,16,32")
    parser.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES))
    parser.add_argument("--kinds", default="qkv,o,gate_up,down,head")
    parser.add_argument("--block-n", default="16,32,64", help="tensor-core tiles: output columns per program")
    parser.add_argument("--block-k", default="128,256,512,1024", help="tensor-core tiles: reduction step")
    parser.add_argument("--warps", default="4,8", help="tensor-core tiles: warps per program")
    parser.add_argument("--stages", default="3,4,6", help="tensor-core tiles: pipelined loads")
    parser.add_argument("--weights", default="bf16", choices=["bf16", "int8"], help="what the program reads")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    device = torch.device("cuda")
    torch.manual_seed(0)
    kinds = args.kinds.split(",")
    tiles = [tuple(int(v) for v in option.split(",")) for option in (args.block_n, args.block_k, args.warps, args.stages)]
    weights = {
        kind: [torch.randn(n, k, dtype=DTYPE, device=device) * 0.02 for _ in range(copies)]
        for kind, (n, k, copies) in SHAPES[args.shape].items() if kind in kinds
    }
    packed: dict[str, list[tuple[torch.Tensor, torch.Tensor | None]]] = {
        kind: [int8_rows(w) if args.weights == "int8" else (w, None) for w in ws] for kind, ws in weights.items()
    }
    bytes_of = {
        kind: sum(v.numel() * v.element_size() + (0 if s is None else s.numel() * 4) for v, s in ps)
        for kind, ps in packed.items()
    }
    results: dict[str, dict[str, object]] = {}
    for rows in (int(r) for r in args.rows.split(",")):
        inputs = {ws[0].shape[1]: torch.randn(rows, ws[0].shape[1], dtype=DTYPE, device=device) for ws in weights.values()}
        total_cublas = total_best = 0.0
        for kind, ws in weights.items():
            x = inputs[ws[0].shape[1]]
            cublas = graph_ms(lambda x=x, ws=ws: [F.linear(x, w) for w in ws])
            entry: dict[str, object] = {"cublas_ms": round(cublas, 4), "cublas_TBps": round(bytes_of[kind] / cublas / 1e9, 3)}
            best: tuple[float, SkinnyConfig] | None = None
            tried = {}
            chosen = skinny_config(rows, x.shape[1], gpu=gpu_model(device), n=ws[0].shape[0])  # the one in use, measured too
            grid = config_grid(rows, tiles)
            for config in grid + ([chosen] if chosen is not None and chosen not in grid else []):
                if not skinny_usable(rows, config):
                    continue
                values, scales = packed[kind][0]
                widened = values if scales is None else (values.float() * scales[:, None]).to(DTYPE)
                expected = F.linear(x, widened).float()
                try:
                    got = skinny_linear(x, values, config, scales).float()
                except Exception as error:  # a tile that does not fit the device (shared memory, registers)
                    tried[str(config)] = f"not run: {type(error).__name__}"
                    continue
                error = ((got - expected).abs().max() / expected.abs().max().clamp_min(1e-6)).item()
                if error > 2e-2:
                    tried[str(config)] = f"wrong (relative error {error:.3g})"
                    continue
                ms = graph_ms(
                    lambda x=x, ps=packed[kind], config=config: [skinny_linear(x, v, config, s) for v, s in ps]
                )
                tried[str(config)] = round(ms, 4)
                if best is None or ms < best[0]:
                    best = (ms, config)
            if best is not None:
                entry.update(
                    best_ms=round(best[0], 4), best_TBps=round(bytes_of[kind] / best[0] / 1e9, 3),
                    best_config=str(best[1]), best_over_cublas=round(best[0] / cublas, 3),
                )
                total_best += min(best[0], cublas)
            else:
                total_best += cublas
            total_cublas += cublas
            entry["tried"] = tried
            results[f"rows{rows}/{kind}"] = entry
            print(f"rows {rows:3d} {kind:8s} cuBLAS {cublas:7.3f} ms ({entry['cublas_TBps']} TB/s)  "
                  f"best {entry.get('best_ms')} ms ({entry.get('best_TBps')} TB/s) {entry.get('best_config')}", flush=True)
        all_bytes = sum(bytes_of.values())
        results[f"rows{rows}/chain"] = {
            "cublas_ms": round(total_cublas, 3), "best_ms": round(total_best, 3),
            "cublas_TBps": round(all_bytes / total_cublas / 1e9, 3), "best_TBps": round(all_bytes / total_best / 1e9, 3),
        }
        print(f"rows {rows:3d} chain    cuBLAS {total_cublas:.3f} ms, best per kind {total_best:.3f} ms", flush=True)
    report = {
        "date": datetime.date.today().isoformat(),
        "device": torch.cuda.get_device_name(),
        "versions": {"torch": torch.__version__, "python": platform.python_version(),
                     "triton": __import__("triton").__version__},
        "command": "python benchmarks/gpu_skinny_gemm.py " + " ".join(
            f"--{key.replace('_', '-')} {value}" for key, value in vars(args).items() if value),
        "weights": f"random bf16, {args.shape} shapes: one copy of each layer matrix per layer, the LM head once"
        + ("; the program reads them as int8 rows + float32 scales" if args.weights == "int8" else ""),
        "results": results,
    }
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(report, handle, indent=1)


if __name__ == "__main__":
    main()
