"""The gated delta rule of one Gated DeltaNet layer over a prompt, on a GPU: the torch chunked form against
flash-linear-attention's kernels (`dflash.kernels.fla_delta_rule`), at Qwen3.5-27B's linear-attention shape (48 value
heads, 16 key heads repeated to them, head dims 128), float32 as the layer feeds it.

    PYTHONPATH=src python benchmarks/gpu_delta_rule.py [--lengths 512,2048,8192] [--out FILE]

Per length: the median time of each form (CUDA events, after a warm-up), the ratio, and the largest difference of
outputs and final states between them.
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

import torch
from gpu_scale_study import median_ms  # benchmarks/ is the script's folder

from dflash.bench.provenance import provenance
from dflash.kernels.fla_delta_rule import fla_chunked_delta_rule, fla_usable
from dflash.models.delta_rule import chunked_delta_rule

HEADS, KEY_DIM, VALUE_DIM = 48, 128, 128


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="512,2048,8192")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    device = torch.device("cuda")
    g = torch.Generator(device=device).manual_seed(0)
    rows = []
    for seq in (int(n) for n in args.lengths.split(",")):
        shape = (1, HEADS, seq)
        q = torch.nn.functional.normalize(torch.randn(*shape, KEY_DIM, device=device, generator=g), dim=-1)
        q = q * KEY_DIM**-0.5
        k = torch.nn.functional.normalize(torch.randn(*shape, KEY_DIM, device=device, generator=g), dim=-1)
        v = torch.randn(*shape, VALUE_DIM, device=device, generator=g)
        decay = -torch.rand(*shape, device=device, generator=g) * 0.3
        beta = torch.rand(*shape, device=device, generator=g)
        state = torch.zeros(1, HEADS, KEY_DIM, VALUE_DIM, device=device)
        assert fla_usable(q), "fla-core is not importable here"
        inputs = (q, k, v, decay, beta, state)
        torch_ms = median_ms(functools.partial(chunked_delta_rule, *inputs), iters=args.repeats)
        fla_ms = median_ms(functools.partial(fla_chunked_delta_rule, *inputs), iters=args.repeats)
        out, final = fla_chunked_delta_rule(*inputs)
        ref_out, ref_final = chunked_delta_rule(*inputs)
        row = {"tokens": seq, "torch_ms": round(torch_ms, 3), "fla_ms": round(fla_ms, 3),
               "speedup": round(torch_ms / fla_ms, 1),
               "max_output_difference": float((out - ref_out).abs().max()),
               "max_state_difference": float((final - ref_final).abs().max()),
               "output_scale": float(ref_out.abs().max())}
        rows.append(row)
        print(json.dumps(row), flush=True)
    result = {"benchmark": "gated delta rule, one layer, torch chunked vs flash-linear-attention",
              **provenance(device), "shape": {"value_heads": HEADS, "key_dim": KEY_DIM, "value_dim": VALUE_DIM},
              "rows": rows}
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
