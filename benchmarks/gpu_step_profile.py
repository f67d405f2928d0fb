"""Where the time of one decoding step goes on the GPU: CUDA kernel table of the Qwen3-8B-shaped target
(random bf16 weights, 2K context), 5 eager steps under torch.profiler.

Usage: python benchmarks/gpu_step_profile.py [--context 2048] [--tokens 1]
"""

from __future__ import annotations

import argparse

import torch
from gpu_scale_study import build_target, filled_cache, target_forward
from torch.profiler import ProfilerActivity, profile


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--tokens", type=int, default=1)
    args = parser.parse_args()
    device = torch.device("cuda")
    model = build_target(device)
    cfg = model.config
    cache = filled_cache(args.context + 80, args.context, cfg.num_kv_heads, cfg.head_dim, cfg.num_layers, device)
    step = target_forward(model, cache, args.context, args.tokens, tree=False)
    with torch.inference_mode():
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                step()
            torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=90))


if __name__ == "__main__":
    main()
