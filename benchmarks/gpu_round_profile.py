"""Where a decoding round's time goes on one GPU: graph replays (device time) against the host loop around them.

For the default model's shape (random weights unless `--model` names the real checkpoint) with the shipped
drafter, in one run:
* the device time of each captured graph, replayed back to back (`*_gpu_ms`): the host-driven one-token step,
  16-row verify and tree verify, and the device-resident whole rounds (`dflash.fastpath.resident`: plain step,
  linear round, DDTree round), with torch.profiler's kernel table for the two speculative rounds;
* the same forwards called through the runner with a sync after each (`*_call_ms`: host copies in, replay, output
  copies);
* the decoding loops (plain, linear, DDTree) over `--tokens` new tokens: wall milliseconds per token and per round,
  and the share of the wall the device is busy (rounds x graph device time / wall);
* a cProfile of one linear and one DDTree generation: the host functions that take the round's time;
* every kernel of one replay of each resident graph, in launch order (`kernel_sequence_one_replay`);
* the device time of the tree round's own pieces, each captured alone (`tree_pieces_gpu_ms`): the drafter's top-k
  log-probabilities, the whole tree growth, the walk.

Usage: PYTHONPATH=src python benchmarks/gpu_round_profile.py [--model GGUF] --out results/gpu_round_profile.json
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import io
import json
import platform
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from gpu_scale_study import as_graph, randomise  # benchmarks/ is the script's folder

from dflash.config import ModelConfig
from dflash.drafter.loader import load_drafter
from dflash.drafter.model import DFlashDrafter
from dflash.fastpath.device_tree import TreeBuilder, walk_tree
from dflash.fastpath.runner import GraphRunner, attach_graph_runner, padded_rows
from dflash.generation.autoregressive import decode_autoregressive
from dflash.generation.forwards import forwards_for
from dflash.generation.output import OutputSink
from dflash.generation.request import GenerationRequest, GenerationStats
from dflash.generation.sampling import SamplingParams
from dflash.generation.selection import TokenChooser
from dflash.models.model import CausalLM
from dflash.models.registry import MODEL_CLASSES
from dflash.speculative.ddtree import decode_ddtree
from dflash.speculative.linear import decode_linear
from dflash.speculative.tree import topk_log_probs

DTYPE = torch.bfloat16


def smollm2_config() -> ModelConfig:
    return ModelConfig(
        architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
        num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
        max_position_embeddings=8192, tie_word_embeddings=True, layer_types=("full_attention",) * 30,
    )


def random_target(device: torch.device) -> CausalLM:
    with torch.device("meta"):
        model = MODEL_CLASSES["llama"](smollm2_config())
    model = model.to_empty(device=device).to(DTYPE)
    randomise(model)
    model.lm_head.weight = model.embed_tokens.weight
    return model.eval().requires_grad_(False)


def load_models(model_path: str | None, device: torch.device) -> tuple[CausalLM, DFlashDrafter, Callable[[list[int]], str]]:
    if model_path is None:
        target = random_target(device)
        drafter = load_drafter("default", target.config, device=device, dtype=DTYPE)
        return target, drafter, lambda ids: ""
    from dflash.engine.engine import EngineOptions
    from dflash.engine.loading import LoadOptions, load_engine

    engine = load_engine(model_path, "default", options=EngineOptions(cuda_graphs=False),
                         loading=LoadOptions(device="cuda", dtype="bfloat16", weights="dense"))
    assert engine.drafter is not None
    return engine.target, engine.drafter, engine.tokenizer.decode


def replay_gpu_ms(runner: GraphRunner, key_prefix: tuple[object, ...], iters: int = 200) -> float | None:
    """Device time of one replay of the graph whose key starts with `key_prefix` (smallest bucket first)."""
    keys = sorted((k for k in runner._replays if k[: len(key_prefix)] == key_prefix), key=str)
    if not keys:
        return None
    replay = runner._replays[keys[0]]
    for _ in range(10):
        replay.run()
    return device_ms_per_call(replay.run, iters)


def device_ms_per_call(run: Callable[[], object], iters: int) -> float:
    """Device milliseconds per call of `run` over `iters` back-to-back calls."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def kernel_table(runner: GraphRunner, key_prefix: tuple[object, ...], replays: int = 20, rows: int = 25) -> str:
    """torch.profiler's device-time table over `replays` replays of one graph (empty when graph kernels are not
    traced)."""
    keys = sorted((k for k in runner._replays if k[: len(key_prefix)] == key_prefix), key=str)
    if not keys:
        return ""
    replay = runner._replays[keys[0]]
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            replay.run()
        torch.cuda.synchronize()
    return str(prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows, max_name_column_width=70))


def kernel_sequence(runner: GraphRunner, key_prefix: tuple[object, ...]) -> list[str]:
    """The kernels of one replay of a graph, in launch order, with their device microseconds: where a round's
    small kernels come from."""
    keys = sorted((k for k in runner._replays if k[: len(key_prefix)] == key_prefix), key=str)
    if not keys:
        return []
    replay = runner._replays[keys[0]]
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        replay.run()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels.sort(key=lambda e: e.time_range.start)
    return [f"{e.device_time:8.2f} us  {e.name[:90]}" for e in kernels]


def graph_gpu_ms(fn: Callable[[], object], iters: int = 200) -> float:
    """Device milliseconds per replay of `fn` captured alone as a CUDA graph."""
    replay = as_graph(fn)
    replay()
    return device_ms_per_call(replay, iters)


def tree_pieces_gpu_ms(budget: int, depth: int, vocab: int, device: torch.device) -> dict[str, float | bool]:
    """Device time of the tree round's own steps on random drafter logits [depth, vocab] (bf16): the builder's
    path (Triton programs when usable) beside torch ops."""
    logits = torch.randn((depth, vocab), generator=torch.Generator().manual_seed(1)).to(device, DTYPE)
    builder = TreeBuilder(budget, depth, vocab, device)
    reference = TreeBuilder(budget, depth, vocab, device, kernel=False)
    tree = builder.grow(logits)
    choices = torch.randint(0, vocab, (budget + 1,), device=device)
    pieces: dict[str, float | bool] = {"kernels": builder.kernel}
    timings: dict[str, Callable[[], object]] = {
        "topk_log_probs_torch": lambda: topk_log_probs(logits, builder.k),
        "grow_tree": lambda: builder.grow(logits),
        "grow_tree_torch": lambda: reference.grow(logits),
        "walk_tree": lambda: builder.walk(tree, choices),
        "walk_tree_torch": lambda: walk_tree(tree, choices, depth),
    }
    if builder.kernel:
        from dflash.kernels.triton_topk import draft_topk

        timings["topk_log_probs"] = lambda: draft_topk(logits, builder.topk_scratch, builder.top_lp, builder.top_ids)
    for name, fn in timings.items():
        pieces[name] = round(graph_gpu_ms(fn), 4)
    return pieces


def timed_call_ms(fn: Callable[[], object], iters: int = 100) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        started = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def run_loop(
    mode: str, target: CausalLM, drafter: DFlashDrafter, decode: Callable[[list[int]], str], prompt: list[int],
    tokens: int, budget: int,
) -> GenerationStats:
    request = GenerationRequest(prompt_ids=prompt, max_new_tokens=tokens, ignore_eos=True, use_prefix_cache=False)
    sink = OutputSink(decode, eos_ids=(), max_new_tokens=tokens)
    chooser = TokenChooser(SamplingParams(), eos_ids=(), min_tokens=0, vocab_size=target.config.vocab_size,
                           device=target.embed_tokens.weight.device)
    if mode == "ar":
        return decode_autoregressive(target, request, sink, chooser, prefill_chunk=256)
    if mode == "linear":
        return decode_linear(target, drafter, request, sink, chooser, prefill_chunk=256)
    return decode_ddtree(target, drafter, request, sink, chooser, prefill_chunk=256, budget=budget)


def profile_text(fn: Callable[[], object], lines: int = 28) -> str:
    profiler = cProfile.Profile()
    profiler.enable()
    fn()
    profiler.disable()
    stream = io.StringIO()
    pstats.Stats(profiler, stream=stream).sort_stats("tottime").print_stats(lines)
    return stream.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="the default model's GGUF (random weights of its shape when absent)")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--prompt-tokens", type=int, default=200)
    parser.add_argument("--budget", type=int, default=32)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--kernel-rows", type=int, default=25, help="rows of each kernel table")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    device = torch.device("cuda")
    target, drafter, decode = load_models(args.model, device)
    runner = attach_graph_runner(target, drafter, capacity=8192 + 2 * 128 + 16)
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, target.config.vocab_size, (args.prompt_tokens,), generator=generator).tolist()

    loops: dict[str, Any] = {}
    for mode in ("ar", "linear", "ddtree"):
        run_loop(mode, target, drafter, decode, prompt, args.tokens, args.budget)  # warm-up: captures graphs
        walls, rounds = [], 0
        for _ in range(args.runs):
            stats = run_loop(mode, target, drafter, decode, prompt, args.tokens, args.budget)
            walls.append(stats.decode_s)
            rounds = stats.rounds or stats.completion_tokens
        wall = statistics.median(walls)
        loops[mode] = {
            "decode_s": round(wall, 5), "tokens": args.tokens, "rounds": rounds,
            "ms_per_token": round(wall / args.tokens * 1e3, 4), "ms_per_round": round(wall / rounds * 1e3, 4),
        }
        print(mode, loops[mode], flush=True)

    forwards = forwards_for(target)  # the loops' forwards: through the runner
    with torch.inference_mode():
        cache = forwards.new_target_cache(target, 4096)
    cache.length = args.prompt_tokens  # the storage holds the last run's rows; timings do not read their values
    block = torch.zeros((1, 16), dtype=torch.long, device=device)

    def step() -> object:
        cache.length = args.prompt_tokens
        return forwards.forward(target, block[:, :1], cache=cache)

    def verify() -> object:
        cache.length = args.prompt_tokens
        return forwards.forward(target, block, cache=cache, capture=drafter.config.target_layer_ids)

    with torch.inference_mode():  # host-driven forwards, one sync each (captures their graphs too)
        calls = {"step_call_ms": timed_call_ms(step), "verify16_call_ms": timed_call_ms(verify)}
    drafts = drafter.config.block_size - 1
    tree_rows = padded_rows(args.budget + 1)
    # device time per replay; the resident graphs are whole rounds (they advance their state on every replay,
    # which the timing does not read)
    gpu = {
        "step_gpu_ms": replay_gpu_ms(runner, ("target", 1)),
        "verify16_gpu_ms": replay_gpu_ms(runner, ("target", 16)),
        "tree_verify_gpu_ms": replay_gpu_ms(runner, ("target", tree_rows)),
        "resident_step_gpu_ms": replay_gpu_ms(runner, ("resident", 0, None)),
        "resident_linear_round_gpu_ms": replay_gpu_ms(runner, ("resident", drafts, None)),
        "resident_tree_round_gpu_ms": replay_gpu_ms(runner, ("resident", drafts, args.budget)),
    }
    print(gpu, calls, flush=True)
    for mode, key in (("ar", "resident_step_gpu_ms"), ("linear", "resident_linear_round_gpu_ms"),
                      ("ddtree", "resident_tree_round_gpu_ms")):
        busy = gpu[key]
        if busy is not None:
            loops[mode]["device_ms_per_round"] = round(busy, 4)
            loops[mode]["device_busy_share"] = round(busy / loops[mode]["ms_per_round"], 3)
    profiles = {
        mode: profile_text(lambda m=mode: run_loop(m, target, drafter, decode, prompt, args.tokens, args.budget))
        for mode in ("ar", "linear", "ddtree")
    }
    for mode, text in profiles.items():
        print(f"---- cProfile {mode}\n{text}", flush=True)
    sequences = {
        name: kernel_sequence(runner, key)
        for name, key in (("resident_step", ("resident", 0, None)), ("resident_linear_round", ("resident", drafts, None)),
                          ("resident_tree_round", ("resident", drafts, args.budget)))
    }
    for name, lines in sequences.items():
        print(f"---- kernel sequence {name} ({len(lines)} kernels)", *lines, sep="\n", flush=True)
    kernels = {}
    for name, key in (("resident_linear_round", ("resident", drafts, None)),
                      ("resident_tree_round", ("resident", drafts, args.budget))):
        kernels[name] = kernel_table(runner, key, rows=args.kernel_rows)
        print(f"---- kernels {name}\n{kernels[name]}", flush=True)

    with torch.inference_mode():
        pieces = tree_pieces_gpu_ms(args.budget, drafts, target.config.vocab_size, device)
    print("tree pieces", pieces, flush=True)

    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device),
        "versions": {"python": platform.python_version(), "torch": torch.__version__},
        "command": " ".join(["python", *sys.argv]),
        "model": args.model or "random weights of SmolLM2-135M's shape",
        "drafter": "shipped (default)",
        "budget": args.budget,
        "loops": loops,
        "graphs": {k: (round(v, 4) if v is not None else None) for k, v in {**gpu, **calls}.items()},
        "cprofile_top_by_self_time": {mode: text.splitlines() for mode, text in profiles.items()},
        "tree_pieces_gpu_ms": pieces,
        "kernels_per_20_replays": {name: text.splitlines() for name, text in kernels.items()},
        "kernel_sequence_one_replay": sequences,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
