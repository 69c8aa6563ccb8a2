"""`loramux drift`: how far an adapter moves the base on golden prompts."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ..drift_report import drift
from ..errors import ParameterError
from .common import add_model_args


def cmd_drift(args: argparse.Namespace) -> int:
    from ..engine.specs import LoraSpec

    if len(args.lora) != 1:
        raise ParameterError("--lora", "drift compares the base with one adapter: give --lora SRC exactly once")
    spec = LoraSpec.parse(args.lora[0])
    scale = args.scale if args.scale is not None else spec.scale
    result = drift(args.model, spec.source, scale=scale, prompts=args.prompts, max_tokens=args.max_tokens,
                   threads=args.threads, n_gpu_layers=args.gpu_layers, n_ctx=args.n_ctx)
    sys.stdout.write(result.to_json() if args.json else result.table())
    return 0


def add_parsers(sub: Any) -> None:
    """Register `loramux drift`."""
    p = sub.add_parser(
        "drift", help="how far an adapter moves the base model on golden prompts (KL, top-1, continuations)",
        description="Per golden prompt: KL(base ‖ adapter) of the next-token distributions along the prompt "
                    "(mean over positions), top-1 agreement, and both greedy continuations side by side.",
        epilog="examples:\n  loramux drift --lora style.gguf\n  loramux drift --lora style.gguf --scale 0.5 --json\n"
               "  loramux drift base.gguf --lora a.gguf --prompts my_prompts.txt --max-tokens 48",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--scale", type=float, default=None, help="adapter scale (default: SRC's :SCALE suffix, else 1.0)")
    p.add_argument("--prompts", default=None, metavar="FILE",
                   help="prompts, one per line (# comments, \\n for newlines); default: the builtin golden set")
    p.add_argument("--max-tokens", type=int, default=32, help="greedy tokens per continuation (default 32; 0: none)")
    p.add_argument("--json", action="store_true", help="print the report as JSON (for CI)")
    p.set_defaults(func=cmd_drift)


__all__ = ["add_parsers", "cmd_drift"]
