"""Device time of DDTree's tree programs on one GPU, variant by variant (each captured alone in a CUDA graph).

* the drafter's top-k log-probabilities: torch ops (`topk_log_probs`) against the two Triton programs
  (`dflash.kernels.triton_topk`) at several vocabulary segment sizes;
* the fused grow program (`dflash.kernels.triton_tree.tree_grow`) by warp count, against the torch ops;
* the walk program and the K/V path move.

Every Triton variant is checked against torch ops on the same inputs before it is timed.

Usage: PYTHONPATH=src python benchmarks/gpu_tree_kernels.py --out results/gpu_tree_kernels_h100.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
from gpu_round_profile import graph_gpu_ms  # benchmarks/ is the script's folder

from dflash.bench.provenance import provenance
from dflash.fastpath.device_tree import TreeBuilder, walk_tree
from dflash.kernels.triton_kv_move import move_path_rows
from dflash.kernels.triton_topk import TopKScratch, draft_topk
from dflash.kernels.triton_tree import tree_grow
from dflash.speculative.tree import topk_log_probs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--depth", type=int, default=15)
    parser.add_argument("--budgets", default="32,64")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    device = torch.device("cuda")
    depth, vocab = args.depth, args.vocab
    logits = torch.randn((depth, vocab), generator=torch.Generator().manual_seed(1)).to(device, torch.bfloat16)
    timings: dict[str, Any] = {}

    def record(name: str, fn: Any) -> None:
        timings[name] = round(graph_gpu_ms(fn), 4)
        print(name, timings[name], flush=True)

    for budget in (int(b) for b in args.budgets.split(",")):
        k = min(budget, vocab)
        expected_lp, expected_ids = topk_log_probs(logits, k)
        record(f"b{budget}/topk_torch", lambda k=k: topk_log_probs(logits, k))
        for segment, warps in ((512, 1), (1024, 1), (1024, 2), (2048, 2), (2048, 4), (2048, 8), (4096, 8)):
            scratch = TopKScratch(depth, vocab, k, device, segment=segment, warps=warps)
            lp = torch.empty((depth, k), device=device)
            ids = torch.empty((depth, k), dtype=torch.long, device=device)
            draft_topk(logits, scratch, lp, ids)
            torch.testing.assert_close(lp, expected_lp, rtol=0, atol=1e-4)
            timings[f"b{budget}/topk_seg{segment}_w{warps}_same_ids"] = bool(torch.equal(ids, expected_ids))
            record(f"b{budget}/topk_seg{segment}_w{warps}", lambda s=scratch, lp=lp, ids=ids: draft_topk(logits, s, lp, ids))
        builder = TreeBuilder(budget, depth, vocab, device)
        assert builder.kernel, "the tree kernels fell back to torch ops"
        reference = TreeBuilder(budget, depth, vocab, device, kernel=False)
        record(f"b{budget}/grow_torch", lambda r=reference: r.grow(logits))
        builder.grow(logits)  # fills builder.top_lp / top_ids
        for warps in (1, 2, 4, 8) if budget <= 32 else (4, 8):  # few warps spill at larger budgets
            def grow(b: TreeBuilder = builder, w: int = warps) -> object:
                return tree_grow(b.top_lp, b.top_ids, b.pair_parent32, b.pair_rank32, b.pairs, b.grow_scratch,
                                 num_warps=w)
            fast, slow = grow(), reference.grow(logits)
            same = all(torch.equal(a, getattr(slow, f)) for a, f in zip(
                fast, ("tokens", "depths", "parents", "valid", "ancestors"), strict=True))
            timings[f"b{budget}/grow_w{warps}_matches_torch"] = same
            record(f"b{budget}/grow_w{warps}", grow)
        tree = builder.grow(logits)
        choices = torch.randint(0, vocab, (budget + 1,), device=device)
        record(f"b{budget}/walk", lambda b=builder, t=tree, c=choices: b.walk(t, c))
        record(f"b{budget}/walk_torch", lambda t=tree, c=choices: walk_tree(t, c, depth))
    keys = torch.zeros((30, 1, 3, 1024, 64), dtype=torch.bfloat16, device=device)
    values = torch.zeros_like(keys)
    positions = torch.zeros(1024, dtype=torch.long, device=device)
    length = torch.tensor([300], device=device)
    path = torch.arange(depth + 1, device=device) * 2
    record("move_rows", lambda: move_path_rows(keys, values, positions, length, path))

    def move_torch() -> None:
        source, dest = length + path, length + torch.arange(depth + 1, device=device)
        keys.index_copy_(3, dest, keys.index_select(3, source))
        values.index_copy_(3, dest, values.index_select(3, source))
        positions.index_copy_(0, dest, dest)

    record("move_rows_torch", move_torch)
    result = {**provenance(device), "depth": depth, "vocab": vocab, "gpu_ms": timings}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
