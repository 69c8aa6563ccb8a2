"""The `loramux` command line.

One module per command group, each with an ``add_parsers(sub)``; this module builds the parser from
them and reports errors. The shared model/adapter options live in ``cli.common``. Nothing outside
``cli`` imports it: it sits on top of the library.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from ..errors import LoramuxError
from . import bench, convert, cvec, drift, eval, inspect, probe, pull, rpc, run, serve, train

EPILOG = """\
examples:
  loramux run -p "The capital of France is"                      # embedded Gemma 3 270M
  loramux run --lora style.gguf:0.5 --lora hf://owner/repo/domain.gguf -p "Hello"
  loramux run --chat -p "Write a haiku about llamas"
  loramux inspect adapter.gguf --factors
  loramux serve                                                  # embedded model + the example "pirate" adapter
  loramux <command> --help                                       # every command teaches its options

MODEL is optional everywhere: without it loramux uses the embedded Gemma 3 270M (Q4_K_M).
Adapters (SRC) may be a path, an https:// URL or hf://owner/repo/file.gguf[@revision].
"""



# The command groups, in the order `loramux --help` lists them.
COMMAND_GROUPS = (run, inspect, pull, convert, serve, rpc, eval, probe, drift, train, cvec, bench)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="loramux", description="Many LoRA adapters around one GGUF base model on llama.cpp.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--log-level", default="WARNING", help="Python log level (llama.cpp's log included)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for group in COMMAND_GROUPS:
        group.add_parsers(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    level = getattr(logging, str(args.log_level).upper(), logging.WARNING)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    if level >= logging.WARNING:
        # llama.cpp warns about model quirks at every load (e.g. token types); show only its errors
        # unless the user asked for more with --log-level.
        logging.getLogger("loramux.llama").setLevel(logging.ERROR)
    if not getattr(args, "func", None):
        parser.print_help()
        return 1
    try:
        return int(args.func(args) or 0)
    except LoramuxError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


__all__ = ["COMMAND_GROUPS", "EPILOG", "build_parser", "main"]
