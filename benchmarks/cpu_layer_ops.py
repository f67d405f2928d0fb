"""The fused CPU layer operations against the torch operations they replace, on the default model.

Part 1 times each operation at the default model's shapes (1 and 5 rows, 300 cached keys): RMSNorm, rotary,
attention, silu * up, best of 3 x 2,000 calls. Part 2 decodes `--prompts` HumanEval + MT-Bench prompts with
plain decoding, linear DFlash and DDTree (budget 4, the CPU default), the fused operations on and off in
alternation within one process (`--runs` each, median), and reports tokens/s and the ratios.

    python benchmarks/cpu_layer_ops.py --out results/cpu_layer_ops.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from dflash.bench.provenance import provenance, write_result
from dflash.engine.engine import EngineOptions
from dflash.engine.loading import LoadOptions, load_engine
from dflash.generation.request import GenerationRequest
from dflash.kernels.build import LayerOpsKernel, load_layer_ops
from dflash.kernels.fused_cpu import torch_layer_ops
from dflash.models.layers import RMSNorm
from dflash.models.rope import apply_rotary
from dflash.training.prompts import read_prompt_file

PROMPTS = Path(__file__).parent / "prompts"


def best_us(step: Callable[[], object], calls: int = 2000, repeats: int = 3) -> float:
    for _ in range(50):
        step()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(calls):
            step()
        times.append((time.perf_counter() - started) / calls * 1e6)
    return round(min(times), 1)


def times_at(rows: int, ops: LayerOpsKernel, norm: RMSNorm, keys: torch.Tensor,
             values: torch.Tensor) -> dict[str, dict[str, float]]:
    """Each operation at `rows` rows: the torch operations, then the fused call."""
    x, gate_up = torch.randn(1, rows, 576), torch.randn(1, rows, 3072)
    q, cos = torch.randn(1, rows, 9, 64).transpose(1, 2), torch.randn(1, 1, rows, 64)
    with torch_layer_ops():
        torch_side = {
            "rms_norm": best_us(lambda: norm(x)),
            "rotary": best_us(lambda: apply_rotary(q, cos, cos)),
            "attention": best_us(lambda: F.scaled_dot_product_attention(q, keys, values, enable_gqa=True)),
            "silu_mul": best_us(lambda: F.silu(gate_up[..., :1536]) * gate_up[..., 1536:]),
        }
    fused_side = {
        "rms_norm": best_us(lambda: ops.rms_norm(x, norm.weight, 1e-5, False)),
        "rotary": best_us(lambda: ops.rotary(q, cos, cos)),
        "attention": best_us(lambda: ops.attention(q, keys, values, None, 0.125)),
        "silu_mul": best_us(lambda: ops.silu_mul(gate_up)),
    }
    print(f"{rows} rows: torch {torch_side} fused {fused_side}", flush=True)
    return {f"{name}_{rows}_rows_us": {"torch": torch_side[name], "fused": fused_side[name]} for name in torch_side}


@torch.inference_mode()
def operation_times() -> dict[str, dict[str, float]]:
    ops = load_layer_ops()
    norm = RMSNorm(576, 1e-5)
    keys, values = torch.randn(1, 3, 300, 64), torch.randn(1, 3, 300, 64)
    return {**times_at(1, ops, norm, keys, values), **times_at(5, ops, norm, keys, values)}


def decode_times(prompts: int, max_tokens: int, runs: int) -> dict[str, Any]:
    engine = load_engine("default", None, options=EngineOptions(spec="ddtree", ddtree_budget=4),
                         loading=LoadOptions(device="cpu"))
    chats = read_prompt_file(PROMPTS / "humaneval.jsonl")[:prompts] + read_prompt_file(PROMPTS / "mtbench.jsonl")[:prompts]
    requests = [engine.chat_prompt_ids(chat) for chat in chats]

    def run(spec: str) -> tuple[float, int, list[list[int]]]:
        started, tokens, outputs = time.perf_counter(), 0, []
        for ids in requests:
            result = engine.generate(GenerationRequest(prompt_ids=ids, max_new_tokens=max_tokens), spec=spec)
            tokens += len(result.token_ids)
            outputs.append(list(result.token_ids))
        return time.perf_counter() - started, tokens, outputs

    run("none")  # warm-up (kernel build, caches)
    modes = {"ar": "none", "linear": "linear", "ddtree": "ddtree"}
    seconds: dict[str, list[float]] = {f"{m}_{side}": [] for m in modes for side in ("torch", "fused")}
    tokens: dict[str, int] = {}
    same_output: dict[str, bool] = {}
    for r in range(runs):
        for mode, spec in modes.items():
            with torch_layer_ops():
                elapsed_torch, count_torch, out_torch = run(spec)
            elapsed_fused, count_fused, out_fused = run(spec)
            seconds[f"{mode}_torch"].append(elapsed_torch)
            seconds[f"{mode}_fused"].append(elapsed_fused)
            tokens[f"{mode}_torch"], tokens[f"{mode}_fused"] = count_torch, count_fused
            same_output[mode] = out_torch == out_fused
            print(f"run {r + 1}: {mode} torch {count_torch / elapsed_torch:.1f} tokens/s, "
                  f"fused {count_fused / elapsed_fused:.1f} tokens/s", flush=True)
    speed = {key: round(tokens[key] / statistics.median(values), 2) for key, values in seconds.items()}
    ratios = {
        **{f"{m}_fused/{m}_torch": round(speed[f"{m}_fused"] / speed[f"{m}_torch"], 3) for m in modes},
        **{f"{m}/ar_{side}": round(speed[f"{m}_{side}"] / speed[f"ar_{side}"], 3)
           for m in ("linear", "ddtree") for side in ("torch", "fused")},
    }
    return {"prompts": 2 * prompts, "max_tokens": max_tokens, "runs": runs, "tokens_per_s": speed,
            "tokens_per_run": tokens, "ratios": ratios, "same_tokens_fused_and_torch": same_output}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=4, help="prompts from each of HumanEval and MT-Bench")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    result: dict[str, Any] = {**provenance(torch.device("cpu")), "model": "smollm2-135m-instruct (Q4_1 GGUF), "
                              "shipped drafter (Q8_0 rows, 8,192-token shortlist)",
                              "command": "python benchmarks/cpu_layer_ops.py " + " ".join(
                                  f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
                                  if v is not None and k != "out"),
                              "operations": operation_times(),
                              "decoding": decode_times(args.prompts, args.max_tokens, args.runs)}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
    write_result(result, args.out)


if __name__ == "__main__":
    main()
