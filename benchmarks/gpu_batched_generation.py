"""Batched generation and batched target forwards on one GPU (the offline work behind `dflash train`).

A SmolLM2-135M-shaped target with random weights is built on the device (no files needed). Measures, in one run:
* one batched decoding step at the training-data batch size and a typical context length, run eagerly and replayed
  from the `BatchedDecoder`'s CUDA graphs;
* `generate_batch` over one length-sorted batch of random prompts both ways (new tokens per second; the prompts'
  forward, run eagerly in both, timed on its own);
* the frozen target's forward over a training batch (features of 4 layers captured) and the drafter trainer's
  whole step (random examples, 4-layer drafter, block 16), with the target's attention through SDPA's causal
  kernels and through the materialised position mask;
plus a profile of the slowest CUDA kernels of the replayed step.

Usage: python benchmarks/gpu_batched_generation.py --out results/gpu_batched_generation_h100.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from gpu_scale_study import randomise  # benchmarks/ is the script's folder

from dflash.bench.provenance import provenance, write_result
from dflash.config import ModelConfig
from dflash.fastpath.batched_step import PAD_POSITION, BatchedDecoder
from dflash.generation.batched import generate_batch
from dflash.models import model as model_module
from dflash.models.model import CausalLM
from dflash.models.registry import MODEL_CLASSES


def smollm2_config() -> ModelConfig:
    return ModelConfig(
        architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
        num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
        max_position_embeddings=8192, tie_word_embeddings=True, layer_types=("full_attention",) * 30,
    )


def random_model(device: torch.device, dtype: torch.dtype) -> CausalLM:
    config = smollm2_config()
    with torch.device("meta"):
        model = MODEL_CLASSES[config.architecture](config)
    model = model.to_empty(device=device).to(dtype).eval().requires_grad_(False)
    model.lm_head.weight = model.embed_tokens.weight
    randomise(model)
    return model


def timed(fn: Callable[[], Any], device: torch.device, repeats: int) -> float:
    """Median milliseconds of `fn` over `repeats` calls after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize(device)
        started = time.perf_counter()
        fn()
        torch.cuda.synchronize(device)
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def prompts(count: int, low: int, high: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high + 1, (count,), generator=gen)
    return [torch.randint(100, vocab, (int(n),), generator=gen).tolist() for n in lengths]


def timed_steps(decoder: BatchedDecoder, model: CausalLM, context: int, repeats: int) -> float:
    """Median ms of one decoder step over a cache holding `context` positions (half the rows left-padded)."""
    device = model.embed_tokens.weight.device
    batch = decoder.batch
    ids = torch.randint(100, 49152, (batch, context), device=device)
    positions = torch.arange(context, device=device).expand(batch, context).contiguous()
    positions[: batch // 2, : context // 4] = PAD_POSITION
    with torch.inference_mode():
        model(ids, positions, decoder.start(), logits="none")
    tokens = torch.randint(100, 49152, (batch,), device=device)
    step_positions = positions[:, -1] + 1

    def step() -> None:
        with torch.inference_mode():
            decoder.step(tokens, step_positions)
        decoder.cache.crop(context)  # the same context length for every repetition

    return timed(step, device, repeats)


def timed_generation(model: CausalLM, decoder: BatchedDecoder, prompts_: list[list[int]], new_tokens: int
                     ) -> tuple[float, float, int]:
    """(seconds of the prompts' forward, seconds of the whole generation, new tokens) for one batch."""
    device = model.embed_tokens.weight.device
    longest = max(len(p) for p in prompts_)
    ids = torch.randint(100, 49152, (len(prompts_), longest), device=device)
    prefill_s = timed(lambda: model(ids, None, decoder.start(), logits="last"), device, 1) / 1e3
    torch.cuda.synchronize(device)
    started = time.perf_counter()
    generated = generate_batch(model, prompts_, max_new_tokens=new_tokens, eos_ids=[-1], decoder=decoder)
    torch.cuda.synchronize(device)
    return prefill_s, time.perf_counter() - started, sum(len(g) for g in generated)


def timed_training_steps(model: CausalLM, batch: int, length: int, steps: int) -> tuple[float, Any]:
    """Mean ms of the drafter trainer's step (frozen target forward, drafter forward and backward, AdamW) over
    `steps` steps run back to back on random examples of `length` tokens, and a CUDA profile of one step."""
    import random
    import tempfile

    from dflash.training.trainer import DrafterTrainer, TrainSettings, init_drafter, new_drafter_config

    config = new_drafter_config(model, layers=4, block_size=16, mask_token_id=16)
    drafter = init_drafter(config, model, from_target_layers=True, seed=0).to(model.embed_tokens.weight.device)
    gen = random.Random(0)
    # every example exactly `length` tokens (a quarter prompt): one batch shape, so no step pays for a new
    # kernel plan and the two attention paths compare like for like
    examples = [([gen.randrange(100, 49152) for _ in range(length // 4)],
                 [gen.randrange(100, 49152) for _ in range(length - length // 4)]) for _ in range(4 * batch)]
    settings = TrainSettings(steps=10_000, batch_size=batch, max_length=length, lr=3e-4)
    trainer = DrafterTrainer(model, drafter.requires_grad_(True), examples, settings, Path(tempfile.mkdtemp()))
    rng, generator = random.Random(1), torch.Generator().manual_seed(1)
    device = model.embed_tokens.weight.device
    trainer.train_step(rng, generator)
    torch.cuda.synchronize(device)
    started = time.perf_counter()
    for _ in range(steps):  # back to back, as the training loop runs them: the host may queue ahead
        trainer.train_step(rng, generator)
    torch.cuda.synchronize(device)
    ms = (time.perf_counter() - started) * 1e3 / steps
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        trainer.train_step(rng, generator)
        torch.cuda.synchronize(device)
    return ms, prof


def training_forward(model: CausalLM, batch: int, length: int, device: torch.device) -> Callable[[], Any]:
    """The frozen target's forward over a training batch with 4 layers' features captured, as training runs it."""
    ids = torch.randint(100, 49152, (batch, length), device=device)
    capture = (1, 10, 18, 27)

    def forward() -> Any:
        with torch.inference_mode():
            return model(ids, capture=capture, logits="none")

    return forward


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--min-prompt", type=int, default=64)
    parser.add_argument("--max-prompt", type=int, default=512)
    parser.add_argument("--context", type=int, default=600)
    parser.add_argument("--train-batch", type=int, default=32)
    parser.add_argument("--train-length", type=int, default=768)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--skip-generation", action="store_true", help="training figures only")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    device = torch.device("cuda")
    model = random_model(device, torch.bfloat16)
    # length-sorted like the training-data batches (dflash.training.datagen)
    batch_prompts = sorted(prompts(args.batch, args.min_prompt, args.max_prompt, 49152, seed=0), key=len)
    capacity = args.max_prompt + args.new_tokens
    figures: dict[str, Any] = {}
    for name, causal in (("masked", False), ("causal", True)):
        model_module.CAUSAL_KERNELS = causal
        forward_ms = timed(training_forward(model, args.train_batch, args.train_length, device), device, args.repeats)
        step_ms, prof = timed_training_steps(model, args.train_batch, args.train_length, args.repeats * 2)
        figures[f"training_{name}_attention"] = {"target_forward_ms": round(forward_ms, 3),
                                                  "train_step_ms": round(step_ms, 3)}
        print(name, figures[f"training_{name}_attention"], flush=True)
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12), flush=True)
    for name, capture in () if args.skip_generation else (("eager", False), ("graphs", True)):
        decoder = BatchedDecoder(model, args.batch, capacity, capture=capture)
        step_ms = timed_steps(decoder, model, args.context, args.repeats * 4)
        prefill_s, seconds, tokens = timed_generation(model, decoder, batch_prompts, args.new_tokens)
        figures[name] = {
            "decode_step_ms": round(step_ms, 3),
            "prompt_forward_s": round(prefill_s, 3),
            "generate_batch_s": round(seconds, 3),
            "generate_batch_tokens_per_s": round(tokens / seconds, 1),
        }
        print(name, figures[name], flush=True)
        if capture:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                timed_steps(decoder, model, args.context, 3)
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8), flush=True)
        del decoder
        torch.cuda.empty_cache()
    if not args.skip_generation:
        figures["graphs_over_eager"] = {
            "decode_step": round(figures["eager"]["decode_step_ms"] / figures["graphs"]["decode_step_ms"], 2),
            "generate_batch": round(figures["graphs"]["generate_batch_tokens_per_s"]
                                    / figures["eager"]["generate_batch_tokens_per_s"], 2),
        }
    result = {
        **provenance(device),
        "model": "SmolLM2-135M-shaped, random weights, bfloat16",
        "settings": vars(args) | {"out": str(args.out) if args.out else None},
        "figures": figures,
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
    write_result(result, args.out)


if __name__ == "__main__":
    main()
