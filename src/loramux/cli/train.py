"""`loramux train zo`: forward-only LoRA fine-tuning from the command line."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ..train.zo import DEFAULT_TARGETS, ZOConfig
from .common import add_model_args, engine_from_args

EPILOG = """\
data (JSONL, one object per line; formats may be mixed):
  {"text": "..."}                                   every token is learned
  {"prompt": "...", "completion": "..."}            only the completion is learned
  {"messages": [{"role": "user", "content": "..."},
                {"role": "assistant", "content": "..."}]}   only assistant turns (model's chat template)

examples:
  loramux train zo --data examples/data/captain_train.jsonl --eval examples/data/captain_eval.jsonl \\
      -o captain.gguf --steps 300 --log captain.csv --plot captain.png
  loramux train zo --data train.jsonl -o out.gguf --steps 600 --resume out.ckpt-000300.json
  loramux run --lora captain.gguf --chat -p "Hi, I'm Ana."

The trained adapter is an ordinary llama.cpp LoRA GGUF (F32): it loads with --lora anywhere.
"""


def add_parsers(sub: Any) -> None:
    """Register `loramux train zo`."""
    train = sub.add_parser("train", help="train adapters on the (quantized) base model, forward-only",
                           description="Train adapters without backpropagation.")
    tsub = train.add_subparsers(dest="train_command", metavar="METHOD")
    d = ZOConfig()
    p = tsub.add_parser("zo", help="zeroth-order (MeZO/SPSA) LoRA fine-tuning through in-place factor writes",
                        description="Fine-tune a LoRA on the model you serve, quantized, on CPU, with forward "
                                    "passes only: two losses per step along a random direction (MeZO-style "
                                    "SPSA), factors rewritten in place.",
                        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p, loras=False)
    p.add_argument("--data", required=True, metavar="FILE.jsonl", help="training examples (JSONL)")
    p.add_argument("--eval", default=None, metavar="FILE.jsonl",
                   help="held-out examples: evaluated every --eval-every steps; the best factors go to OUT")
    p.add_argument("-o", "--out", required=True, metavar="OUT.gguf", help="adapter to write")
    p.add_argument("--name", default=None, help="adapter name (default: OUT's file name)")
    p.add_argument("--rank", type=int, default=d.rank, help=f"LoRA rank (default {d.rank})")
    p.add_argument("--alpha", type=float, default=None, help="LoRA alpha (default: the rank, i.e. alpha/rank = 1)")
    p.add_argument("--targets", default=",".join(DEFAULT_TARGETS), metavar="PROJ,...",
                   help="projections of every block to adapt: attn_q, attn_k, attn_v, attn_output, ffn_gate, "
                        f"ffn_up, ffn_down (default {','.join(DEFAULT_TARGETS)})")
    p.add_argument("--steps", type=int, default=d.steps, help=f"total steps (default {d.steps})")
    p.add_argument("--batch", type=int, default=d.batch, help=f"examples per step (default {d.batch})")
    p.add_argument("--lr", type=float, default=d.lr, help=f"learning rate (default {d.lr:g})")
    p.add_argument("--eps", type=float, default=d.eps,
                   help=f"perturbation size ε (default {d.eps:g}; much smaller drowns in the quantized "
                        "model's rounding noise)")
    p.add_argument("--schedule", choices=("linear", "constant"), default=d.schedule,
                   help="learning rate: 'linear' decays it to 0 at --steps (default), 'constant' keeps it")
    p.add_argument("--no-normalize", dest="normalize", action="store_false",
                   help="plain MeZO-SGD update θ −= lr·g·z (default: g divided by its running RMS, so lr is "
                        "the step size along z)")
    p.add_argument("--seed", type=int, default=d.seed, help=f"master seed (default {d.seed})")
    p.add_argument("--eval-every", type=int, default=d.eval_every, metavar="K",
                   help=f"evaluate the held-out data every K steps (default {d.eval_every}; 0: start and end only)")
    p.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every, metavar="K",
                   help="write OUT.ckpt-STEP.json/.gguf every K steps and at the end (default 0: none)")
    p.add_argument("--resume", default=None, metavar="CKPT",
                   help="continue from a checkpoint (same data and settings; --steps may be larger)")
    p.add_argument("--log", default=None, metavar="FILE.csv|.json", help="per-step log (losses, ĝ, timings)")
    p.add_argument("--plot", default=None, metavar="FILE.png", help="loss curve (needs matplotlib)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_train_zo)
    train.set_defaults(func=lambda args: _no_method(train))


def _no_method(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 1


def cmd_train_zo(args: argparse.Namespace) -> int:
    """Run `loramux train zo` and print a summary."""
    from ..train.zo import train_zo

    eng = engine_from_args(args)
    try:
        hyper = dict(rank=args.rank, alpha=args.alpha, targets=args.targets, steps=args.steps, batch=args.batch,
                     lr=args.lr, eps=args.eps, seed=args.seed, eval_every=args.eval_every,
                     checkpoint_every=args.checkpoint_every, schedule=args.schedule,
                     normalize=args.normalize)
        res = train_zo(eng, args.data, args.out, eval_data=args.eval, name=args.name, resume=args.resume,
                       log=args.log, plot=args.plot, progress=not args.quiet, **hyper)
    finally:
        eng.close()
    out = sys.stdout
    print(f"trained {res.steps} steps, {res.n_params:,} parameters, {res.wall_seconds:.1f} s", file=out)
    if res.eval_history:
        print(f"held-out loss: {res.initial_eval_loss:.4f} at the start → {res.final_eval_loss:.4f} at the end; "
              f"best {res.best_eval_loss:.4f} at step {res.best_step}", file=out)
    elif res.losses:
        print(f"train loss: first step {res.losses[0]:.4f}, last step {res.losses[-1]:.4f}", file=out)
    n = max(res.steps, 1)
    print(f"per step: forward {1e3 * res.forward_seconds / n:.1f} ms, factor writes "
          f"{1e3 * res.write_seconds / n:.2f} ms ({100 * res.write_share:.2f} % of the step)", file=out)
    print(f"wrote {res.out}" + (f" (best), {res.last} (last)" if res.last else ""), file=out)
    for extra in (res.log_file, res.plot_file):
        if extra:
            print(f"wrote {extra}", file=out)
    if args.plot and res.plot_file is None:
        print("no plot: matplotlib is not installed (pip install matplotlib)", file=out)
    if res.checkpoints:
        print(f"checkpoint: {res.checkpoints[-1]}", file=out)
    return 0


__all__ = ["EPILOG", "add_parsers", "cmd_train_zo"]
