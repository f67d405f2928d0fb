"""CPU attention over a paged K/V pool: gathering each layer's keys and values through the request's slots and
running the contiguous kernel (`attention`), beside reading them in place (`attention_slots`).

A 30-layer-like loop: per layer, one attention of 9 query heads over 3 key heads of 64 values, the request's
keys in blocks of 16 slots at random places of a pool twice its size (at least 1,024 slots); 256 / 1,024 / 4,096
keys, 1 / 5 / 16 query rows (a step, small and large verifications), the new rows causal. Also the contiguous
kernel over copies gathered in advance (the attention alone, what the gather adds to). Microseconds per 30-layer
pass, the best of 5 rounds in which the three take turns, in one process.

    python benchmarks/cpu_attention_slots.py --out results/cpu_attention_slots.json
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from dflash.bench.provenance import provenance, write_result
from dflash.kernels.build import LayerOpsKernel, load_layer_ops

LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 30, 9, 3, 64, 16


def best_us(steps: dict[str, Callable[[], object]], seconds: float) -> dict[str, float]:
    """Each step's best time in microseconds per call, over 5 rounds in which the steps take turns (so that a
    change of load on a shared machine falls on all of them), each round `seconds` of calls per step."""
    counts = {}
    for name, step in steps.items():  # warm-up, and the calls that fill `seconds`
        started = time.perf_counter()
        step()
        counts[name] = max(1, round(seconds / max(time.perf_counter() - started, 1e-6)))
    best = dict.fromkeys(steps, float("inf"))
    for _ in range(5):
        for name, step in steps.items():
            started = time.perf_counter()
            for _ in range(counts[name]):
                step()
            best[name] = min(best[name], (time.perf_counter() - started) / counts[name] * 1e6)
    return {name: round(us, 1) for name, us in best.items()}


def request_slots(keys: int, pool_slots: int, generator: torch.Generator) -> torch.Tensor:
    """The slots of a request of `keys` keys: whole blocks of BLOCK slots, picked at random over the pool."""
    blocks = torch.randperm(pool_slots // BLOCK, generator=generator)[: (keys + BLOCK - 1) // BLOCK]
    return (blocks[:, None] * BLOCK + torch.arange(BLOCK)).flatten()[:keys]


def measure(ops: LayerOpsKernel, keys: int, rows: int, seconds: float) -> dict[str, float]:
    generator = torch.Generator().manual_seed(keys + rows)
    pool_slots = max(2 * keys, 1024)
    pool_k = torch.randn(LAYERS, KV_HEADS, pool_slots, HEAD_DIM, generator=generator)  # [layers, kv, slots, d]
    pool_v = torch.randn(LAYERS, KV_HEADS, pool_slots, HEAD_DIM, generator=generator)
    slots = request_slots(keys, pool_slots, generator)
    q = torch.randn(HEADS, rows, HEAD_DIM, generator=generator)  # [heads, rows, d]
    mask = torch.ones(rows, keys, dtype=torch.bool).tril(keys - rows)  # [rows, keys]
    q4, mask4 = q[None], mask[None, None]
    gathered = [(pool_k[i][:, slots][None], pool_v[i][:, slots][None]) for i in range(LAYERS)]

    def gather_then_attend() -> None:
        for layer in range(LAYERS):
            k = pool_k[layer][:, slots][None]  # [1, kv, keys, d], a fresh copy
            v = pool_v[layer][:, slots][None]
            ops.attention(q4, k, v, mask4, 0.125)

    def attend_in_place() -> None:
        for layer in range(LAYERS):
            ops.attention_slots(q, pool_k[layer], pool_v[layer], slots, mask, 0.125)

    def attend_pregathered() -> None:
        for k, v in gathered:
            ops.attention(q4, k, v, mask4, 0.125)

    for layer in (0, LAYERS - 1):  # the two paths agree before they are timed
        want = ops.attention(q4, *gathered[layer], mask4, 0.125)[0]
        assert torch.equal(ops.attention_slots(q, pool_k[layer], pool_v[layer], slots, mask, 0.125), want)
    times = best_us(
        {
            "gather_attention_us": gather_then_attend,
            "attention_slots_us": attend_in_place,
            "pregathered_attention_us": attend_pregathered,
        },
        seconds,
    )
    return {**times, "speedup": round(times["gather_attention_us"] / times["attention_slots_us"], 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=0.2, help="per step and round")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    ops = load_layer_ops()
    figures: dict[str, Any] = {}
    for keys in (256, 1024, 4096):
        for rows in (1, 5, 16):
            figures[f"{keys}_keys_{rows}_rows"] = measure(ops, keys, rows, args.seconds)
    result = {
        **provenance(torch.device("cpu")),
        "command": f"python benchmarks/cpu_attention_slots.py --seconds {args.seconds} --threads {args.threads}",
        "threads": torch.get_num_threads(),
        "shape": {"layers": LAYERS, "heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "block": BLOCK},
        "figures_us_per_30_layers": figures,
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
    write_result(result, args.out)


if __name__ == "__main__":
    main()
