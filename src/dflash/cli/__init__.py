"""`dflash` command line: serve | chat | generate | bench | train | inspect | connect."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from dflash.errors import DFlashError


def build_parser() -> argparse.ArgumentParser:
    from dflash.cli import bench, chat, connect, generate, inspect, train

    parser = argparse.ArgumentParser(prog="dflash", description="Lossless speculative decoding (DFlash, DDTree).")
    parser.add_argument("-v", "--verbose", action="store_true", help="log engine events")
    commands = parser.add_subparsers(dest="command", required=True)
    try:
        serve = importlib.import_module("dflash.cli.serve")
        serve.register(commands)
    except ImportError:  # the HTTP stack is optional; the engine works without it
        pass
    chat.register(commands)
    generate.register(commands)
    bench.register(commands)
    train.register(commands)
    inspect.register(commands)
    connect.register(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.run(args) or 0)
    except DFlashError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
