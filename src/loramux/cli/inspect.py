"""`loramux inspect`: describe a GGUF (base model, adapter or control vector) without loading it."""

from __future__ import annotations

import argparse
import json
from typing import Any


def cmd_inspect(args: argparse.Namespace) -> int:
    from ..inspect import describe_file

    info = describe_file(args.file, factors=args.factors)
    if args.json:
        print(json.dumps(info, indent=2, default=str))
        return 0
    for k, v in info.items():
        if k == "factors":
            print("factors:")
            for f in v:
                print(f"  {f['name']:<40} A{tuple(f['a'])} B{tuple(f['b'])} {f['dtype']}")
        elif isinstance(v, list) and len(v) > 8:
            print(f"{k}: {v[:8]} … ({len(v)} in all)")
        else:
            print(f"{k}: {v}")
    return 0


def add_parsers(sub: Any) -> None:
    p = sub.add_parser("inspect", help="show what a GGUF holds (base model, adapter or control vector)",
                       description="Describe a GGUF file without loading it into llama.cpp.")
    p.add_argument("file", help="a .gguf file")
    p.add_argument("--factors", action="store_true", help="list every LoRA factor pair with its shapes")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_inspect)


__all__ = ["add_parsers", "cmd_inspect"]
