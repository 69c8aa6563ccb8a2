"""`loramux cvec train`: compute a control vector from contrastive example files."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ..engine.control import METHODS, POOLS, ControlVector, parse_layers, read_examples
from ..errors import ParameterError
from .common import add_model_args, engine_from_args


def cmd_cvec_train(args: argparse.Namespace) -> int:
    pos, neg = read_examples(args.positive), read_examples(args.negative)
    if len(pos) != len(neg):
        raise ParameterError("--positive/--negative", f"{len(pos)} positive but {len(neg)} negative examples",
                             hint="the files are paired line by line: give both the same number of examples")
    eng = engine_from_args(args)
    try:
        cv = ControlVector.train(eng, pos, neg, method=args.method, layers=parse_layers(args.layers),
                                 pool=args.pool, progress=not args.quiet)
    finally:
        eng.close()
    if args.scale != 1.0:
        cv = cv.scaled(args.scale)
    cv.save(args.output)
    print(f"wrote {args.output}: {len(cv.layers)} layers × {cv.n_embd}, method {args.method}, "
          f"{len(pos)} pairs")
    print(f"{'layer':>5} {'norm':>10} {'agree':>6} {'var':>6}")
    for k, n in cv.norms().items():
        st = cv.stats.get(k, {})
        var = st.get("explained")
        print(f"{k:>5} {n:>10.3f} {st.get('agree', float('nan')):>6.2f} "
              f"{'' if var is None else f'{var:6.2f}'}")
    return 0


def add_parsers(sub: Any) -> None:
    """Register `loramux cvec train`."""
    p = sub.add_parser("cvec", help="control vectors: compute one from contrastive examples",
                       description="Control vectors (llama.cpp's --control-vector format).")
    csub = p.add_subparsers(dest="cvec_command", metavar="SUBCOMMAND")
    t = csub.add_parser(
        "train", help="compute a control vector from positive/negative example files",
        description="Compute a control vector from paired examples (line i of --positive pairs with line i "
                    "of --negative) on the base model, and write llama.cpp's control-vector GGUF.",
        epilog="example: loramux cvec train --positive happy.txt --negative sad.txt -o happy.gguf\n"
               "then:    loramux run --control-vector happy.gguf:0.25 -p 'My week at work was'",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(t, loras=False)
    t.add_argument("--positive", required=True, metavar="P.txt",
                   help="positive examples, one per line (.txt) or {\"text\": ...} per line (.jsonl)")
    t.add_argument("--negative", required=True, metavar="N.txt", help="negative examples, paired with --positive")
    t.add_argument("-o", "--output", required=True, metavar="OUT.gguf", help="control-vector GGUF to write")
    t.add_argument("--method", choices=METHODS, default="pca", help="pca (default) or mean difference")
    t.add_argument("--pool", choices=POOLS, default="mean",
                   help="mean of the residual over tokens (default) or the last token's")
    t.add_argument("--layers", default=None, metavar="A-B",
                   help="layers to compute (inclusive, 1-based = direction.N; default 1..n_layer-1)")
    t.add_argument("--scale", type=float, default=1.0, help="multiply the result before saving (default 1)")
    t.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    t.set_defaults(func=cmd_cvec_train)
    p.set_defaults(func=lambda _a: (p.print_help(sys.stderr), 1)[1])


__all__ = ["add_parsers", "cmd_cvec_train"]
