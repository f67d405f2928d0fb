"""`dflash chat`: an interactive terminal chat that streams the model's replies."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from dflash.cli.common import (
    add_model_options,
    add_prefix_cache_option,
    add_sampling_options,
    engine_from_args,
    sampling_from_args,
)
from dflash.generation.request import GenerationRequest


def register(commands: Any) -> None:
    parser = commands.add_parser("chat", help="interactive chat in the terminal", description=__doc__)
    parser.add_argument("--system", default=None, help="system message")
    add_model_options(parser)
    add_prefix_cache_option(parser)
    add_sampling_options(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    print("loading model...", file=sys.stderr, flush=True)
    engine = engine_from_args(args, one_at_a_time=True)
    spec = engine.options.spec
    print(f"{engine.model_name} ({spec} decoding). Empty line or /exit quits, /reset clears the conversation.",
          file=sys.stderr)
    messages: list[dict[str, Any]] = [{"role": "system", "content": args.system}] if args.system else []
    sampling = sampling_from_args(args)
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip() or line.strip() == "/exit":
            break
        if line.strip() == "/reset":
            messages = messages[:1] if args.system else []
            continue
        messages.append({"role": "user", "content": line})
        request = GenerationRequest(
            prompt_ids=engine.chat_prompt_ids(messages), max_new_tokens=args.max_tokens, sampling=sampling,
            stop=tuple(args.stop),
        )

        def stream(text: str, _ids: list[int]) -> None:
            sys.stdout.write(text)
            sys.stdout.flush()

        result = engine.generate(request, on_text=stream)
        s = result.stats
        extra = f", acceptance {s.acceptance_length:.2f}" if s.rounds else ""
        print(f"\n[{s.completion_tokens} tokens, {s.tokens_per_s:.1f} tok/s{extra}]", file=sys.stderr)
        messages.append({"role": "assistant", "content": result.text})
    return 0
