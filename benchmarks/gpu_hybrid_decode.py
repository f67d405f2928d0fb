"""Plain decoding of a Qwen3.5-27B-shaped hybrid (random bf16 weights) end to end through the decoding loop, eager
and through the graph runner, in one process on one GPU; and where an eager one-token step spends its host time.
Each side decodes the same request twice and the second is timed.

* `eager` / `graphed_unfused` / `graphed`: `decode_autoregressive` over a random prompt (prefill in chunks, then one step a token),
  tokens/s of the decoding part (`GenerationStats.decode_s`) and the prompt's seconds, through the runner's
  unfused static forwards and its fused ones (`dflash.fastpath.fused_hybrid`); the greedy tokens compared (bf16:
  equal unless a near tie flips);
* `eager_step_profile`: torch's profiler over a few eager steps, the operations with the most host time, with
  the delta rule's program and with the torch rule (`DFLASH_DELTA_RULE_PROGRAM=0`).

Usage: python benchmarks/gpu_hybrid_decode.py --out results/gpu_hybrid_decode_h100.json [--layers N]
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import torch
from gpu_family_scale_study import build, model_configs  # benchmarks/ is on the path

from dflash.bench.provenance import provenance
from dflash.fastpath.runner import attach_graph_runner
from dflash.generation.autoregressive import decode_autoregressive
from dflash.generation.forwards import register_forwards
from dflash.generation.output import OutputSink
from dflash.generation.request import GenerationRequest
from dflash.generation.sampling import SamplingParams
from dflash.generation.selection import TokenChooser
from dflash.models.model import CausalLM


def generate(model: CausalLM, prompt: list[int], new_tokens: int, chunk: int) -> dict[str, Any]:
    request = GenerationRequest(prompt_ids=prompt, max_new_tokens=new_tokens, ignore_eos=True)
    sink = OutputSink(lambda ids: "", eos_ids=(), max_new_tokens=new_tokens)
    chooser = TokenChooser(SamplingParams(), eos_ids=(), min_tokens=0, vocab_size=model.config.vocab_size,
                           device=model.embed_tokens.weight.device)
    with torch.inference_mode():
        stats = decode_autoregressive(model, request, sink, chooser, prefill_chunk=chunk)
    torch.cuda.synchronize()
    steps = len(sink.token_ids) - 1  # the first token comes from the prompt's forward
    return {
        "tokens": sink.token_ids,
        "decode_tokens_per_s": round(steps / stats.decode_s, 2),
        "prefill_s": round(stats.prefill_s, 3),
    }


def step_profile(model: CausalLM, prompt: list[int]) -> list[dict[str, Any]]:
    """The eager one-token step's operations with the most host time (5 profiled steps after 3 warm ones)."""
    device = model.embed_tokens.weight.device
    cache = model.new_cache(len(prompt) + 16)
    with torch.inference_mode():
        model(torch.tensor([prompt], device=device), cache=cache, logits="last")
        token = torch.tensor([[1]], device=device)
        for _ in range(3):
            model(token, cache=cache)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(5):
                model(token, cache=cache)
            torch.cuda.synchronize()
    rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:12]
    return [
        {"op": e.key, "calls_per_step": e.count // 5, "self_cpu_ms_per_step": round(e.self_cpu_time_total / 5e3, 3)}
        for e in rows
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    device = torch.device("cuda")
    config = model_configs(args.layers)["qwen3.5-27b"]
    model = build(config, device)
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, config.vocab_size, (args.prompt,), generator=generator).tolist()
    out: dict[str, Any] = {"model": "qwen3.5-27b shape, random bf16", "layers": config.num_layers,
                           "prompt_tokens": args.prompt, "new_tokens": args.new_tokens, "prefill_chunk": args.chunk}
    # each side runs the generation once untimed: kernels compiled, cuDNN's attention plans for every key length
    # built (eager), every graph of these shapes and buckets captured (graphed)
    generate(model, prompt, args.new_tokens, args.chunk)
    eager = generate(model, prompt, args.new_tokens, args.chunk)
    runs = {}
    for label, fused in (("graphed_unfused", False), ("graphed", None)):  # None: fused where the model takes it
        runner = attach_graph_runner(model, None, capacity=args.prompt + args.new_tokens + 256, fused=fused)
        try:
            generate(model, prompt, args.new_tokens, args.chunk)
            runs[label] = generate(model, prompt, args.new_tokens, args.chunk)
            out[f"{label}_graphs_captured"], out[f"{label}_fused"] = runner.captured, runner.fused
        finally:
            register_forwards(model, None)
        del runner
    graphed = runs["graphed"]
    out["eager"] = {k: v for k, v in eager.items() if k != "tokens"}
    for label, run in runs.items():
        out[label] = {k: v for k, v in run.items() if k != "tokens"}
    out["unfused_same_tokens_as_eager"] = runs["graphed_unfused"]["tokens"] == eager["tokens"]
    out["graphed_over_eager"] = round(graphed["decode_tokens_per_s"] / eager["decode_tokens_per_s"], 2)
    out["same_tokens"] = graphed["tokens"] == eager["tokens"]
    out["first_difference"] = next(
        (i for i, (a, b) in enumerate(zip(eager["tokens"], graphed["tokens"], strict=False)) if a != b), None
    )
    step_profile(model, prompt[:64])  # the profiled steps' attention plans built first
    out["eager_step_profile"] = {"program": step_profile(model, prompt[:64])}
    os.environ["DFLASH_DELTA_RULE_PROGRAM"] = "0"
    out["eager_step_profile"]["torch_rule"] = step_profile(model, prompt[:64])
    os.environ.pop("DFLASH_DELTA_RULE_PROGRAM")
    out["provenance"] = provenance(device)
    print(json.dumps({k: v for k, v in out.items() if k != "eager_step_profile"}), flush=True)
    print(json.dumps(out["eager_step_profile"]), flush=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
