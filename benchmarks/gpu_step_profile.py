"""Where the time of one decoding forward goes on the GPU: the CUDA kernel table of the Qwen3-8B-shaped target
and published-shape drafter (random bf16 weights), through the product's runner with the fused kernels but
without graph capture (the same kernels a graph replays), 5 calls under torch.profiler.

Usage: python benchmarks/gpu_step_profile.py [--context 2048] [--what step|verify|drafter] [--draft-vocab N]
"""

from __future__ import annotations

import argparse

import torch
from gpu_scale_study import build_drafter, build_target, runner_draft, runner_target
from torch.profiler import ProfilerActivity, profile

from dflash.fastpath.runner import GraphRunner


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--what", choices=("step", "verify", "drafter"), default="step")
    parser.add_argument("--draft-vocab", type=int, default=0, help="the drafter scores this many random ids only")
    args = parser.parse_args()
    device = torch.device("cuda")
    torch.manual_seed(0)
    model = build_target(device)
    drafter = build_drafter(device) if args.what == "drafter" else None
    if drafter is not None and args.draft_vocab:
        shortlist = torch.randperm(model.config.vocab_size, generator=torch.Generator().manual_seed(0))
        drafter.use_draft_vocab(shortlist[: args.draft_vocab].sort().values, model)
    runner = GraphRunner(model, drafter, capacity=args.context + 256, capture=False, fused=True)
    with torch.inference_mode():
        if drafter is not None:
            cache = runner.lease_drafter_cache(args.context + 200)
            storage = runner.drafter_storage
        else:
            cache = runner.lease_target_cache(args.context + 200)
            storage = runner.target_storage
        assert cache is not None and storage is not None
        storage.keys.normal_()
        storage.values.normal_()
        storage.positions[0, : args.context] = torch.arange(args.context, device=device)
        if drafter is not None:
            call = runner_draft(runner, cache, args.context)
        else:
            call = runner_target(runner, cache, args.context, 1 if args.what == "step" else 16, tree=False)
        for _ in range(3):
            call()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                call()
            torch.cuda.synchronize()
    print(f"{args.what} at context {args.context}" + (f", draft vocab {args.draft_vocab}" if args.draft_vocab else ""))
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=90))


if __name__ == "__main__":
    main()
