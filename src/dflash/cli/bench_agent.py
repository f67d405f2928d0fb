"""`dflash bench agent-loop | agent-session | prefix-repro`: the prefix cache under agent workloads, measured
from the client side of a running server."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def register_agent_commands(kinds: Any) -> None:
    loop = kinds.add_parser("agent-loop", help="replay an agent transcript against a cold and a warm server")
    loop.add_argument("--transcript", type=Path, required=True, help="Claude Code JSONL or OpenAI-style messages")
    loop.add_argument("--base-url", required=True, help="the server measured warm (prefix cache on)")
    loop.add_argument("--cold-base-url", default=None,
                      help="a server with the prefix cache off (default: --base-url, cache switched off per request)")
    loop.add_argument("--model", default="any")
    loop.add_argument("--max-tokens", type=int, default=64)
    loop.add_argument("--no-tools", action="store_true", help="do not send tool definitions")
    loop.add_argument("--long-prefix-tokens", type=int, default=7500,
                      help="prompts at least this long make the long-prefix figures (default 7500)")
    loop.add_argument("--json", action="store_true")
    loop.add_argument("--out", type=Path, default=None, help="also write the JSON result here")
    loop.set_defaults(run=run_agent_loop)

    session = kinds.add_parser("agent-session", help="write a synthetic agent session (Claude Code JSONL)")
    session.add_argument("--out", type=Path, required=True)
    session.add_argument("--max-prefix-tokens", type=int, default=7900,
                         help="estimated prompt tokens of the last call; keep it plus max tokens within the context")
    session.add_argument("--first-output-tokens", type=int, default=150)
    session.add_argument("--growth", type=float, default=1.3, help="tool output growth per step")
    session.add_argument("--max-output-tokens", type=int, default=700)
    session.add_argument("--seed", type=int, default=0)
    session.add_argument("--tokenizer", default="default", help="model whose tokenizer counts tokens")
    session.set_defaults(run=run_agent_session)

    repro = kinds.add_parser("prefix-repro", help="growing-prefix agent loop; fails on an empty warm answer")
    repro.add_argument("--base-url", required=True)
    repro.add_argument("--model", default="any")
    repro.add_argument("--calls", type=int, default=8)
    repro.add_argument("--max-tokens", type=int, default=48)
    repro.add_argument("--max-prefix-tokens", type=int, default=6000)
    repro.add_argument("--compare-cold", action="store_true",
                       help="also send every prompt with the prefix cache off and fail on a different answer")
    repro.add_argument("--tokenizer", default="default", help="model whose tokenizer sizes the tool outputs")
    repro.add_argument("--json", action="store_true")
    repro.set_defaults(run=run_prefix_repro)


def token_counter(model: str) -> Any:
    from dflash.models.resolve import load_checkpoint

    tokenizer = load_checkpoint(model).tokenizer
    if tokenizer is None:
        print(f"warning: {model} has no tokenizer; counting 4 characters per token", file=sys.stderr)
        return lambda text: max(1, len(text) // 4)
    return lambda text: len(tokenizer.encode(text))


def run_agent_loop(args: argparse.Namespace) -> int:
    from dflash.bench.agent_loop import ReplaySettings, format_table, replay
    from dflash.bench.transcript import load_transcript

    transcript = load_transcript(args.transcript)
    settings = ReplaySettings(
        base_url=args.base_url, cold_base_url=args.cold_base_url, model=args.model, max_tokens=args.max_tokens,
        send_tools=not args.no_tools, long_prefix_tokens=args.long_prefix_tokens,
    )

    def progress(index: int, total: int, row: dict[str, Any]) -> None:
        print(f"call {index + 1}/{total}: {row['prompt_tokens']} prompt tokens, time to first token cold "
              f"{row['cold']['ttft_s']} s, warm {row['warm']['ttft_s']} s", file=sys.stderr, flush=True)

    result = replay(transcript, settings, on_call=progress)
    result["command"] = agent_loop_command(args)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result) if args.json else format_table(result))
    totals = result["totals"]
    return 1 if totals["empty_answers"]["warm"] or totals["errors"]["warm"] else 0


def agent_loop_command(args: argparse.Namespace) -> str:
    """The command line that reproduces this run (from the parsed options, whoever called the parser)."""
    parts = ["dflash bench agent-loop", f"--transcript {args.transcript}", f"--base-url {args.base_url}"]
    if args.cold_base_url:
        parts.append(f"--cold-base-url {args.cold_base_url}")
    parts += [f"--model {args.model}", f"--max-tokens {args.max_tokens}", f"--long-prefix-tokens {args.long_prefix_tokens}"]
    if args.no_tools:
        parts.append("--no-tools")
    if args.out:
        parts.append(f"--out {args.out}")
    return " ".join(parts)


def run_agent_session(args: argparse.Namespace) -> int:
    from dflash.bench.synthetic_session import SessionShape, synthetic_session

    shape = SessionShape(
        max_prefix_tokens=args.max_prefix_tokens, first_output_tokens=args.first_output_tokens, growth=args.growth,
        max_output_tokens=args.max_output_tokens, seed=args.seed,
    )
    records = synthetic_session(shape, token_counter(args.tokenizer))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(r) + "\n" for r in records))
    calls = sum(1 for r in records if r["type"] == "assistant" and r["message"]["content"][0]["type"] == "text")
    print(f"wrote {len(records)} records ({calls} assistant turns) to {args.out}")
    return 0


def run_prefix_repro(args: argparse.Namespace) -> int:
    from dflash.bench.prefix_repro import ReproSettings, reproduce
    from dflash.bench.synthetic_session import SessionShape

    settings = ReproSettings(
        base_url=args.base_url, model=args.model, calls=args.calls, max_tokens=args.max_tokens,
        compare_cold=args.compare_cold, shape=SessionShape(max_prefix_tokens=args.max_prefix_tokens),
    )

    def progress(row: dict[str, Any]) -> None:
        state = "EMPTY" if row["empty"] else ("error" if row["error"] else "ok")
        print(f"call {row['call']}: {row['prompt_tokens']} prompt tokens, {row['cached_tokens']} cached, "
              f"time to first token {row['ttft_s']} s, {state}", file=sys.stderr, flush=True)

    result = reproduce(settings, token_counter(args.tokenizer), on_call=progress)
    if args.json:
        print(json.dumps(result))
    else:
        print("passed" if result["passed"] else "FAILED:\n  " + "\n  ".join(result["failures"]))
    return 0 if result["passed"] else 1
