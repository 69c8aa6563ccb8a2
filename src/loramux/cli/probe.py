"""`loramux probe`: the known-answer probe of a build (see docs/probe.md)."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

from ..errors import ParameterError, ProbeMismatch
from ..probe_refs import CROSS_BUILD_RTOL, pick_reference, reference_name
from ..probes import ProbeResult, probe
from .common import add_model_args

SHIPPED = "shipped"  # --check shipped: the references in loramux's package data


def cmd_probe(args: argparse.Namespace) -> int:
    if len(args.lora) > 1:
        raise ParameterError("--lora", "the probe takes one adapter (give --lora once)")
    if args.write and args.check:
        raise ParameterError("--write/--check", "choose one: write a new reference or check against one")
    if not (args.rtol >= 0 and math.isfinite(args.rtol)):
        raise ParameterError("--rtol", f"must be a finite number >= 0, got {args.rtol!r}")
    lora = None
    if args.lora:
        from ..engine.specs import LoraSpec

        spec = LoraSpec.parse(args.lora[0])
        if spec.scale != 1.0:
            raise ParameterError("--lora", f"the probe applies its adapter at scale 1.0; drop ':{spec.scale:g}'")
        lora = spec.source
    ref = ProbeResult.load(args.check) if args.check and args.check != SHIPPED else None
    # --n-ctx is not passed on: the probe's context is fixed (256) so its numbers depend on nothing else.
    result = probe(args.model, lora, threads=args.threads, n_gpu_layers=args.gpu_layers, progress=None,
                   use_mmap=not args.no_mmap)
    rtol, label = args.rtol, args.check
    if args.check == SHIPPED:  # the reference of this build if loramux ships one, else the nearest build's
        try:
            name, ref, own = pick_reference(result)
        except ProbeMismatch as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        label = f"the shipped reference {name}"
        rtol = rtol if own or rtol else CROSS_BUILD_RTOL
    if args.json:
        sys.stdout.write(result.to_json())
    else:
        sys.stdout.write(result.table(ref, markdown=args.markdown))
        if not args.markdown:
            print(f"[{result.run['elapsed_s']:.2f} s]", file=sys.stderr)
    if ref is not None:
        try:
            cmp = result.check(ref, rtol)
        except ProbeMismatch as e:
            print(f"error: {e}", file=sys.stderr)
            return 1 if not getattr(e, "foreign", None) else 2
        how = "exact" if cmp.exact else f"rtol {cmp.rtol:g}"
        across = "".join(f"\n  - {f}" for f in cmp.foreign)
        print(f"probe matches {label} ({how}; {cmp.values} values, largest relative offset {cmp.max_offset:.2e}"
              + (f"; reference from another build:{across})" if across else ")"), file=sys.stderr)
        return 0
    if result.violations:
        print("error: within-run invariants broken:\n  - " + "\n  - ".join(result.violations), file=sys.stderr)
        if args.write:
            print(f"not writing {args.write}: a reference must come from a run whose invariants hold", file=sys.stderr)
        return 1
    if args.write:
        target = Path(args.write)
        if target.is_dir():  # one reference per build identity, named after it
            target = target / f"{reference_name(result.build)}.json"
        result.write(target)
        print(f"wrote {target}", file=sys.stderr)
    return 0


def add_parsers(sub: Any) -> None:
    """Register `loramux probe`."""
    p = sub.add_parser(
        "probe", help="known-answer probe: exact losses of fixed prompts under a fixed adapter",
        description="Score fixed prompts with a fixed adapter (zeroed, perturbed ±ε in place, restored, "
                    "dropped) and print the exact losses; write them as a reference for this build, or check "
                    "a run against one (exact equality: same build ⇒ bit-identical; a reference from another "
                    "build is refused unless --rtol is given).",
        epilog="examples:\n  loramux probe --threads 2 --write ref.json\n  loramux probe --threads 2 --check ref.json\n"
               "  loramux probe --threads 2 --check other-build.json --rtol 0.02\n"
               "  loramux probe base.gguf --lora my-adapter.gguf --markdown\n"
               "  loramux probe --threads 2 --check shipped           # this install against loramux's own\n"
               "exit codes: 0 ok, 1 rows moved or invariants broken, 2 reference refused (other build without "
               "--rtol, other model or setup) or bad input",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--write", metavar="REF.json",
                   help="write this run as the reference for this build (a directory: named after the build)")
    g.add_argument("--check", metavar="REF.json",
                   help="compare with a reference of the same build; exit 1 if a row moved. 'shipped': the "
                        "references that ship with loramux (the default model), exactly for this build's "
                        "own, else within --rtol (default 0.02) of the nearest build's")
    p.add_argument("--rtol", type=float, default=0.0,
                   help="relative tolerance for --check (default 0: exact, as one build is bit-identical); "
                        "with it a reference from another build is compared instead of refused")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--markdown", action="store_true", help="print the table as markdown")
    p.set_defaults(func=cmd_probe)


__all__ = ["SHIPPED", "add_parsers", "cmd_probe"]
