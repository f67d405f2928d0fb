"""Where one decode step of the default model goes on this machine: the whole step, a bare chain of its
weight matrix-vector products (the memory-bandwidth floor for dense fp32 weights), the LM head alone, and
torch's 4-bit grouped kernel against fp32 on one MLP matrix; then the same step and chain with the GGUF's
quantized blocks through our CPU kernel (`--weights quantized`), at 1 row and at 16 rows (a linear verification).

    .venv/bin/python benchmarks/cpu_decode_floor.py --out results/cpu_decode_floor.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from dflash.models.quantized_layers import QuantizedLinear
from dflash.models.quantized_model import build_quantized_model
from dflash.models.quantized_weights import QuantizedCheckpoint
from dflash.models.registry import build_model
from dflash.models.resolve import load_checkpoint


def per_call_ms(fn: Callable[[], object], repeats: int) -> float:
    for _ in range(3):
        fn()
    started = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - started) / repeats * 1000


@torch.inference_mode()
def quantized_figures(repeats: int) -> dict[str, float]:
    """Step and matrix chain of the quantized model, 1 and 16 rows, through the Q4_1/Q8_0 kernel."""
    checkpoint = load_checkpoint("default", weights="quantized")
    assert isinstance(checkpoint, QuantizedCheckpoint)
    model = build_quantized_model(checkpoint)
    cache = model.new_cache(600)
    model(torch.arange(1, 300)[None], cache=cache)
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    figures: dict[str, float] = {"weight_mb_per_token": round(sum(m.blocks.numel() for m in layers) / 1e6, 1)}
    for rows in (1, 16):
        tokens = torch.full((1, rows), 5)
        inputs = [torch.randn(rows, m.in_features) for m in layers]

        def step(tokens: torch.Tensor = tokens) -> None:
            cache.crop(299)
            model(tokens, cache=cache)

        def chain(inputs: list[torch.Tensor] = inputs) -> None:
            for m, x in zip(layers, inputs, strict=True):
                m(x)

        figures[f"step_ms_{rows}_rows"] = round(per_call_ms(step, repeats), 2)
        figures[f"weight_chain_ms_{rows}_rows"] = round(per_call_ms(chain, repeats), 2)
    return figures


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    checkpoint = load_checkpoint("default")
    model = build_model(checkpoint.config, checkpoint.weights)
    cache = model.new_cache(600)
    model(torch.arange(1, 300)[None], cache=cache)
    token = torch.tensor([[5]])

    def step() -> None:
        cache.crop(299)
        model(token, cache=cache)

    matrices = [w for layer in model.layers for w in (layer.self_attn.qkv_proj.weight, layer.self_attn.o_proj.weight,
                                                      layer.mlp.gate_up_proj.weight, layer.mlp.down_proj.weight)]
    inputs = {k: torch.randn(1, k) for k in {w.shape[1] for w in matrices}}

    def chain() -> None:
        for w in matrices:
            F.linear(inputs[w.shape[1]], w)
        F.linear(inputs[model.lm_head.weight.shape[1]], model.lm_head.weight)

    head = model.lm_head.weight
    x_head = torch.randn(1, head.shape[1])
    # 4-bit grouped weights (group 32, scale and zero per group) for one gate/up matrix
    n, k, group = 3072, 576, 32
    q = torch.randint(0, 16, (n, k), dtype=torch.int32)
    scale, low = torch.rand(n, k // group) * 0.01, torch.randn(n, k // group) * 0.01
    dense = (q.float().view(n, k // group, group) * scale[..., None] + low[..., None]).view(n, k)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    scales_zeros = torch.stack([scale.t(), (low + 8 * scale).t()], dim=-1).contiguous()
    x = torch.randn(1, k)
    weight_bytes = sum(w.numel() * w.element_size() for w in matrices) + head.numel() * head.element_size()
    result = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "device": f"cpu ({platform.machine()}, {torch.get_num_threads()} threads)",
        "versions": {"python": platform.python_version(), "torch": torch.__version__},
        "model": "smollm2-135m-instruct (fp32)",
        "command": "python benchmarks/cpu_decode_floor.py --out " + str(args.out),
        "weight_mb_per_token": round(weight_bytes / 1e6, 1),
        "decode_step_ms": round(per_call_ms(step, args.repeats), 2),
        "weight_chain_ms": round(per_call_ms(chain, args.repeats), 2),
        "lm_head_ms": round(per_call_ms(lambda: F.linear(x_head, head), args.repeats), 2),
        "gate_up_fp32_us": round(per_call_ms(lambda: F.linear(x, dense), 200) * 1000, 1),
        "gate_up_int4_us": round(per_call_ms(
            lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group, scales_zeros), 200) * 1000, 1),
    }
    result["quantized"] = quantized_figures(args.repeats)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
