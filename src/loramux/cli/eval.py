"""`loramux eval`: score a JSONL of prompts with choices (or references) under several adapters in one run."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ..errors import ParameterError
from .common import add_model_args, options_from_args


def cmd_eval(args: argparse.Namespace) -> int:
    from ..engine.runtime import Engine
    from ..engine.specs import LoraSpec
    from ..evaluate import evaluate, load_items

    specs = [LoraSpec.parse(s) for s in args.lora]
    if not specs and args.no_base:
        raise ParameterError("--no-base", "nothing to score: give --lora adapters or drop --no-base")
    items = load_items(args.data)
    names = [s.name or _name(s.source) for s in specs]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ParameterError("--lora", f"two adapters are named {dupes[0]!r}", hint="name them: --lora NAME=SRC")
    slots = args.slots if args.slots is not None else len(specs)
    opts = options_from_args(args, n_parallel=args.parallel, slots=slots, slot_rank=args.slot_rank)
    eng = Engine.load(args.model, options=opts)
    try:
        for s, n in zip(specs, names):
            eng.load_lora(s.source, n)
        sets: dict[str, Any] = {} if args.no_base else {"base": {}}
        sets.update({n: {n: s.scale} for s, n in zip(specs, names)})
        report = evaluate(eng, items, sets, batch=args.batch)
    finally:
        eng.close()
    if args.json:
        json.dump({"items": report.items, "sequences": report.sequences, "elapsed_s": report.elapsed_s,
                   "results": [{"adapter": r.name, "accuracy": r.accuracy, "accuracy_norm": r.accuracy_norm,
                                "nll": r.nll, "mc_items": r.mc_items, "scores": r.scores}
                               for r in report.results]}, sys.stdout)
        print()
    else:
        sys.stdout.write(report.table())
    if args.plot:
        out = report.plot(args.plot)
        print(f"wrote {out}" if out else "no plot: matplotlib is not installed (pip install matplotlib)",
              file=sys.stderr)
    return 0


def _name(source: str) -> str:
    from ..engine.specs import adapter_name

    return adapter_name(source)


def add_parsers(sub: Any) -> None:
    """Register `loramux eval`."""
    p = sub.add_parser(
        "eval", help="which adapter is best: accuracy and NLL of each adapter on a JSONL of scored items",
        description="Score every item of a JSONL file under the base model and each --lora adapter (each alone), "
                    "in one run: sequences on different adapters share decode steps through the slot bank. "
                    "Each line: {\"prompt\": ..., \"choices\": [...], \"answer\": INDEX or TEXT} (multiple "
                    "choice: the choice with the highest log-likelihood is the model's answer) or {\"prompt\": "
                    "..., \"reference\": ...} (NLL only). Prints accuracy, length-normalised accuracy, NLL per "
                    "token and perplexity per adapter (see docs/scoring.md).",
        epilog="examples:\n  loramux eval items.jsonl --lora a.gguf --lora b.gguf\n"
               "  loramux eval items.jsonl --lora math=hf://me/adapters/math.gguf --plot adapters.png\n"
               "  loramux eval items.jsonl base.gguf --lora x.gguf --no-base --json",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("data", metavar="ITEMS.jsonl", help="the items to score, one JSON object per line")
    add_model_args(p, loras=False)
    p.add_argument("--lora", action="append", default=[], metavar="[NAME=]SRC[:SCALE]",
                   help="an adapter to compare (repeatable; each is scored alone, not stacked)")
    p.add_argument("--no-base", action="store_true", help="do not score the base model itself")
    p.add_argument("--slots", type=int, default=None,
                   help="slot-bank slots (default: one per adapter, so all share each decode; 0: rotate)")
    p.add_argument("--slot-rank", type=int, default=16, metavar="R",
                   help="largest adapter rank a slot holds (default 16; a larger adapter is scored in turns)")
    p.add_argument("--parallel", type=int, default=8, help="sequences decoded together (default 8)")
    p.add_argument("--batch", type=int, default=64, help="sequences queued at a time (default 64)")
    p.add_argument("--plot", default=None, metavar="FILE.png", help="bar chart of accuracy and NLL (matplotlib)")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.set_defaults(func=cmd_eval)


__all__ = ["add_parsers", "cmd_eval"]
