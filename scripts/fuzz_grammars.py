#!/usr/bin/env python
"""Fuzz loramux's constraints longer than CI does: the generator and worker of tests/test_adversarial.py.

    python scripts/fuzz_grammars.py --examples 5000 [--cpu 10] [--only regex,gbnf,schema,tool]

Runs the fuzz tests of tests/test_adversarial.py with LORAMUX_FUZZ_EXAMPLES cases per kind (regexes,
GBNF grammars, JSON schemas, tool schemas) and a CPU allowance per case (LORAMUX_FUZZ_CPU_S). Each
case is turned into a grammar, compiled on the tiny model and run for a few tokens in a worker process
with a memory limit; a crash, a case past its allowance or an untyped error fails, and hypothesis
prints the smallest failing case. Exit status: pytest's.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--examples", type=int, default=2000, help="cases per kind (default 2000)")
    ap.add_argument("--cpu", type=float, default=10.0, help="CPU seconds a case may take (default 10)")
    ap.add_argument("--only", default=None, help="comma-separated kinds (default: all four)")
    args = ap.parse_args()
    env = {**os.environ, "LORAMUX_FUZZ_EXAMPLES": str(args.examples), "LORAMUX_FUZZ_CPU_S": str(args.cpu),
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    kinds = args.only.split(",") if args.only else ["regex", "gbnf", "schema", "tool"]
    select = " or ".join(f"fuzz and {k}" for k in kinds)
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", str(ROOT / "tests" / "test_adversarial.py"), "-k", select,
           "-p", "no:cacheprovider"]
    return subprocess.call(cmd, env=env, cwd=ROOT)


if __name__ == "__main__":
    raise SystemExit(main())
