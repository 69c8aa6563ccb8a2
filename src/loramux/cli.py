"""The `loramux` command line.

Each feature module registers its own subcommands (`add_parsers`); this module holds the shared
pieces (model/adapter options, error reporting) and the core commands: run and inspect.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys
from collections.abc import Sequence
from typing import Any

from .errors import LoramuxError

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

# Feature modules that add subcommands; a missing one (optional extra) just hides its commands.
FEATURE_MODULES = ("sources", "cli_convert", "cli_serve", "probes", "control", "train.cli", "cli_bench")


def add_model_args(p: argparse.ArgumentParser, *, loras: bool = True) -> None:
    """MODEL, --lora, --n-ctx, --threads, --gpu-layers: shared by run, serve, probe, train..."""
    p.add_argument("model", nargs="?", default=None, metavar="MODEL",
                   help="base GGUF model (default: the embedded Gemma 3 270M Q4_K_M)")
    if loras:
        p.add_argument("--lora", action="append", default=[], metavar="SRC[:SCALE]",
                       help="adapter to apply (repeatable; stacked in order). SRC: path, https:// URL or "
                            "hf://owner/repo/file.gguf[@rev]; optional :SCALE (default 1.0); NAME=SRC names it")
    p.add_argument("--n-ctx", type=int, default=2048, help="context length in tokens (default 2048)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: all available)")
    p.add_argument("--gpu-layers", type=int, default=0, help="layers to offload to a GPU build (default 0)")
    p.add_argument("--no-mmap", action="store_true", help="read the model into memory instead of mapping it")


def engine_from_args(args: argparse.Namespace, **extra: Any) -> Any:
    """Build an Engine from the shared options."""
    from .runtime import Engine, LoraSpec

    specs = [LoraSpec.parse(s) for s in getattr(args, "lora", [])]
    return Engine.load(args.model, loras=specs, n_ctx=args.n_ctx, n_threads=args.threads,
                       n_gpu_layers=args.gpu_layers, use_mmap=not args.no_mmap, **extra)


def add_control_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--control-vector", action="append", default=[], metavar="FILE[:STRENGTH]",
                   help="control vector GGUF to add to the residual stream (repeatable; summed)")
    p.add_argument("--control-vector-layers", default=None, metavar="A-B",
                   help="apply control vectors only to layers A..B (inclusive, 1-based)")


def apply_control_args(engine: Any, args: argparse.Namespace) -> None:
    if not getattr(args, "control_vector", None):
        return
    from .control import ControlSetting, ControlVector, parse_layers
    from .runtime import LoraSpec

    pairs = []
    for text in args.control_vector:
        spec = LoraSpec.parse(text)
        pairs.append((ControlVector.load(spec.source), spec.scale))
    setting = ControlSetting.build(engine.model, pairs, parse_layers(args.control_vector_layers))
    engine.call(lambda: setattr(engine, "control", setting))


# ------------------------------------------------------------------------------------------ run
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


def _add_run(sub: Any) -> None:
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


# -------------------------------------------------------------------------------------- inspect
def cmd_inspect(args: argparse.Namespace) -> int:
    from .inspect_file import describe_file

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


def _add_inspect(sub: Any) -> None:
    p = sub.add_parser("inspect", help="show what a GGUF holds (base model, adapter or control vector)",
                       description="Describe a GGUF file without loading it into llama.cpp.")
    p.add_argument("file", help="a .gguf file")
    p.add_argument("--factors", action="store_true", help="list every LoRA factor pair with its shapes")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_inspect)


# ----------------------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="loramux", description="Many LoRA adapters around one GGUF base model on llama.cpp.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--log-level", default="WARNING", help="Python log level (llama.cpp's log included)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_run(sub)
    _add_inspect(sub)
    for mod in FEATURE_MODULES:
        try:
            m = importlib.import_module(f".{mod}", __package__)
        except ModuleNotFoundError as e:
            if e.name and e.name.startswith("loramux"):
                continue
            raise
        if hasattr(m, "add_parsers"):
            m.add_parsers(sub)
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
