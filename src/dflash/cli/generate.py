"""`dflash generate`: one completion from the command line (streamed, or one JSON object with --json)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from dflash.cli.common import add_model_options, add_sampling_options, engine_from_args, sampling_from_args
from dflash.cli.ranks import add_tensor_parallel_option, run_ranks, tensor_parallel_size
from dflash.errors import DFlashError
from dflash.generation.request import GenerationRequest


def register(commands: Any) -> None:
    parser = commands.add_parser("generate", help="generate one completion", description=__doc__)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="user message (the chat template is applied unless --raw)")
    source.add_argument("--prompt-ids", help="comma-separated token ids, used as they are")
    parser.add_argument("--raw", action="store_true", help="send --prompt without the chat template")
    parser.add_argument("--system", default=None, help="system message for the chat template")
    parser.add_argument("--json", action="store_true", help="print one JSON object with text, ids and stats")
    add_model_options(parser)
    add_tensor_parallel_option(parser)
    add_sampling_options(parser)
    parser.set_defaults(run=run)


def prompt_ids_from_args(engine: Any, args: argparse.Namespace) -> list[int]:
    if args.prompt_ids is not None:
        try:
            return [int(x) for x in args.prompt_ids.split(",") if x.strip()]
        except ValueError:
            raise DFlashError(f"--prompt-ids must be comma-separated integers, got {args.prompt_ids!r}") from None
    if args.raw:
        return list(engine.encode(args.prompt))
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
        {"role": "user", "content": args.prompt}
    ]
    return list(engine.chat_prompt_ids(messages))


def run(args: argparse.Namespace) -> int:
    if tensor_parallel_size(args) > 1:
        return run_ranks(args, generate_with)
    return generate_with(engine_from_args(args, one_at_a_time=True), args)


def generate_with(engine: Any, args: argparse.Namespace) -> int:
    """Generate the flags' completion with `engine` (the first rank's, under --tensor-parallel)."""
    request = GenerationRequest(
        prompt_ids=prompt_ids_from_args(engine, args),
        max_new_tokens=args.max_tokens,
        sampling=sampling_from_args(args),
        stop=tuple(args.stop),
    )

    def stream(text: str, _ids: list[int]) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    result = engine.generate(request, on_text=None if args.json else stream)
    if args.json:
        stats = result.stats.as_dict()
        stats["spec"] = engine.spec_mode_for(request, None)
        print(json.dumps({
            "text": result.text, "token_ids": result.token_ids, "finish_reason": result.finish_reason, "stats": stats,
        }, ensure_ascii=False))
    else:
        sys.stdout.write("\n")
        s = result.stats
        extra = f", acceptance length {s.acceptance_length:.2f}" if s.rounds else ""
        print(f"[{s.completion_tokens} tokens, {s.tokens_per_s:.1f} tokens/s{extra}]", file=sys.stderr)
    return 0
