"""`loramux run`: generate text with a base model and stacked adapters, streamed to the terminal."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from .common import add_control_args, add_model_args, apply_control_args, engine_from_args


def cmd_run(args: argparse.Namespace) -> int:
    eng = engine_from_args(args)
    try:
        apply_control_args(eng, args)
        sampling = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                        top_p=args.top_p, seed=args.seed, stop=tuple(args.stop))
        if args.chat:
            stream = eng.chat([{"role": "user", "content": args.prompt}], stream=True, **sampling)
        else:
            stream = eng.stream(args.prompt, **sampling)
            if not args.quiet:
                sys.stdout.write(args.prompt)
        for chunk in stream:
            sys.stdout.write(chunk)
            sys.stdout.flush()
        sys.stdout.write("\n")
        c = stream.completion
        if args.verbose and c is not None:
            print(f"[{c.prompt_tokens} prompt + {c.completion_tokens} generated tokens, "
                  f"finish: {c.finish_reason}, adapters: {c.loras or 'none'}]", file=sys.stderr)
            for name, hit in c.alora.items():
                if not hit:
                    print(f"[aLoRA {name}: invocation sequence not in the prompt, ran without it]",
                          file=sys.stderr)
    finally:
        eng.close()
    return 0


def add_parsers(sub: Any) -> None:
    p = sub.add_parser("run", help="generate text with a base model and stacked adapters",
                       description="Generate text, streamed to the terminal.",
                       epilog="example: loramux run --lora style.gguf:0.5 -p 'Once upon a time'",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    add_control_args(p)
    p.add_argument("-p", "--prompt", required=True, help="the prompt (or the user message with --chat)")
    p.add_argument("--chat", action="store_true", help="treat the prompt as a chat message (model's template)")
    p.add_argument("-n", "--max-tokens", type=int, default=128, help="tokens to generate (default 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("-q", "--quiet", action="store_true", help="do not echo the prompt")
    p.add_argument("-v", "--verbose", action="store_true", help="print token counts and adapters at the end")
    p.set_defaults(func=cmd_run)


__all__ = ["add_parsers", "cmd_run"]
