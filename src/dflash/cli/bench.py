"""`dflash bench`: acceptance length on prompt sets, decoding speed against baselines, the prefix cache under agent
loops (agent-loop, agent-session, prefix-repro), and random-weight GGUF files at real shapes (make-gguf)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from dflash.cli.bench_agent import register_agent_commands
from dflash.cli.common import add_model_options, engine_from_args
from dflash.errors import DFlashError

DEFAULT_PROMPTS = Path("benchmarks/prompts")


def register(commands: Any) -> None:
    parser = commands.add_parser("bench", help="benchmarks", description=__doc__)
    kinds = parser.add_subparsers(dest="bench_command", required=True)

    acceptance = kinds.add_parser("acceptance", help="mean acceptance length on prompt sets (greedy)")
    add_model_options(acceptance)
    acceptance.add_argument("--prompts-file", type=Path, action="append", required=True, help="JSONL (repeatable)")
    acceptance.add_argument("--max-tokens", type=int, default=256)
    acceptance.add_argument("--limit", type=int, default=None, help="first N prompts of each file")
    acceptance.add_argument("--json", action="store_true", help="print one JSON object")
    acceptance.add_argument("--out", type=Path, default=None, help="also write the JSON result here")
    acceptance.set_defaults(run=run_acceptance)

    speed = kinds.add_parser("speed", help="tokens/s of our decoding against baselines, in one run")
    add_model_options(speed)
    speed.add_argument("--prompts-file", type=Path, action="append", default=None)
    speed.add_argument("--limit", type=int, default=8, help="prompts per file")
    speed.add_argument("--max-tokens", type=int, default=128)
    speed.add_argument("--runs", type=int, default=1, help="repetitions (median reported)")
    speed.add_argument("--baseline-runs", type=int, default=None,
                       help="repetitions of the transformers modes (default: --runs)")
    speed.add_argument("--modes", default="transformers,ar,linear",
                       help="comma list of: transformers, transformers-pld, ar, linear, ddtree, ddtree:N, llama.cpp "
                       "(llama.cpp's llama-bench on the same GGUF file)")
    speed.add_argument("--threads", type=int, default=None,
                       help="CPU threads of the run, ours and llama-bench's (default: torch's)")
    speed.add_argument("--llama-bench", default=None, metavar="PATH",
                       help="llama-bench executable of the llama.cpp mode (default: $DFLASH_LLAMA_BENCH, else on PATH)")
    speed.add_argument("--llama-bench-args", default="", metavar="ARGS",
                       help='extra llama-bench arguments, appended as given (e.g. --llama-bench-args="--repack 0")')
    speed.add_argument("--json", action="store_true")
    speed.add_argument("--out", type=Path, default=None)
    speed.set_defaults(run=run_speed)

    # "resolve": this command's --max-concurrency (alias --max-batch, default: the top level) replaces the shared one
    concurrency = kinds.add_parser("concurrency", help="aggregate tokens/s and latency under N concurrent requests",
                                   conflict_handler="resolve")
    add_model_options(concurrency)
    concurrency.add_argument("--concurrency", default="1,2,4,8,16,32", help="comma list of concurrent clients")
    concurrency.add_argument("--modes", default="ar,linear,ddtree", help="comma list of: ar, linear, ddtree")
    concurrency.add_argument("--requests", type=int, default=None,
                             help="requests per level (default: 2 x the level, at least 4)")
    concurrency.add_argument("--max-tokens", type=int, default=128,
                             help="tokens of every request (EOS ignored; with --length-spread the centre of the range)")
    concurrency.add_argument("--length-spread", type=float, default=0.0, metavar="R",
                             help="request i's tokens drawn from i in [max_tokens (1 - R), max_tokens (1 + R)], the "
                                  "same in every mode (default 0: every request max_tokens)")
    concurrency.add_argument("--temperature", type=float, default=0.0,
                             help="sample every request at this temperature (request i seeded with i; default greedy)")
    concurrency.add_argument("--top-p", type=float, default=1.0)
    concurrency.add_argument("--top-k", type=int, default=0)
    concurrency.add_argument("--prompts-file", type=Path, action="append", default=None)
    concurrency.add_argument("--sequential", action="store_true", help="also time the same requests one at a time")
    concurrency.add_argument("--max-concurrency", "--max-batch", dest="max_concurrency", type=int, default=None,
                             metavar="N", help="requests decoded together (default: the highest --concurrency)")
    concurrency.add_argument("--no-warmup", dest="warmup", action="store_false")
    concurrency.add_argument("--warmup-requests", type=int, default=None,
                             help="untimed requests per level and mode before it is timed (default: one per client; "
                                  "the level's --requests also captures every prompt's shapes first)")
    concurrency.add_argument("--json", action="store_true")
    concurrency.add_argument("--out", type=Path, default=None)
    concurrency.set_defaults(run=run_concurrency)

    make_gguf = kinds.add_parser(
        "make-gguf", help="write a random-weight GGUF at a real model shape (for speed comparisons on one file)"
    )
    make_gguf.add_argument("--shape", default="qwen3-8b",
                           help="qwen3-8b, qwen3-32b, qwen3-0.6b, smollm2-135m (not in q4_k_m), tiny, or the "
                                "Qwen3.5 hybrids qwen3.5-27b and tiny-hybrid")
    make_gguf.add_argument("--quant", default="q4_k_m", help="q4_k_m (llama.cpp's mix), q8_0, q4_1 or q4_0")
    make_gguf.add_argument("--seed", type=int, default=0)
    make_gguf.add_argument("--out", type=Path, required=True)
    make_gguf.set_defaults(run=run_make_gguf)

    register_agent_commands(kinds)


def _emit(result: dict[str, Any], args: argparse.Namespace, summary: str) -> None:
    result["command"] = "dflash " + " ".join(sys.argv[1:])
    text = json.dumps(result, indent=None if args.json else 2)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(text if args.json else summary)


def run_acceptance(args: argparse.Namespace) -> int:
    from dflash.bench.acceptance import measure_acceptance

    engine = engine_from_args(args)
    if engine.drafter is None:
        print("error: acceptance needs a drafter (--draft)", file=sys.stderr)
        return 2
    result = measure_acceptance(engine, args.prompts_file, max_tokens=args.max_tokens, spec=args.spec, limit=args.limit)
    lines = [f"{name}: acceptance length {s['acceptance_length']:.3f} over {s['prompts']} prompts"
             for name, s in result["sets"].items()]
    lines.append(f"mean over all prompts: {result['acceptance_length']:.3f}")
    _emit(result, args, "\n".join(lines))
    return 0


def run_speed(args: argparse.Namespace) -> int:
    import torch

    from dflash.bench.llama_cpp_peer import LLAMA_CPP_MODE, prepare_peer
    from dflash.bench.speed import measure_speed
    from dflash.bench.speed_report import format_speed_table

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    # the peer is checked before the engine loads: a missing llama-bench should not cost a load and a warm-up
    peer = prepare_peer(args.model, args.llama_bench, args.llama_bench_args) if LLAMA_CPP_MODE in modes else None
    if args.threads is not None:
        if args.threads < 1:
            raise DFlashError(f"--threads must be at least 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    engine = engine_from_args(args)
    files = args.prompts_file or [DEFAULT_PROMPTS / "humaneval.jsonl", DEFAULT_PROMPTS / "mtbench.jsonl"]
    result = measure_speed(
        engine, files, modes=modes, limit=args.limit, max_tokens=args.max_tokens, runs=args.runs,
        model_arg=args.model, baseline_runs=args.baseline_runs, llama_bench=peer,
    )
    _emit(result, args, format_speed_table(result))
    return 0


def run_concurrency(args: argparse.Namespace) -> int:
    from dflash.bench.concurrency import engine_takes_threads, format_concurrency_table, measure_concurrency
    from dflash.generation.sampling import SamplingParams

    levels = [int(level) for level in args.concurrency.split(",") if level.strip()]
    sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)  # checked first
    if args.max_concurrency is None and engine_takes_threads():
        args.max_concurrency = max(levels, default=1)  # below the top level, the top levels would only queue
    engine = engine_from_args(args)
    if args.warmup:
        engine.warm_up()  # the GPU's graphs are captured before any level is timed, as `dflash serve` does
    result = measure_concurrency(
        engine,
        args.prompts_file or [DEFAULT_PROMPTS / "humaneval.jsonl", DEFAULT_PROMPTS / "mtbench.jsonl"],
        modes=[m.strip() for m in args.modes.split(",") if m.strip()], levels=levels, max_tokens=args.max_tokens,
        requests=args.requests, sequential=args.sequential, warmup=args.warmup, warmup_requests=args.warmup_requests,
        sampling=sampling, length_spread=args.length_spread,
    )
    _emit(result, args, format_concurrency_table(result))
    return 0


def run_make_gguf(args: argparse.Namespace) -> int:
    from dflash.bench.random_gguf import write_random_gguf

    path = write_random_gguf(args.out, args.shape, args.quant, seed=args.seed)
    print(f"wrote {path} ({path.stat().st_size / 2**30:.2f} GiB)")
    return 0
