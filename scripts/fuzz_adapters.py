#!/usr/bin/env python
"""Fuzz loramux's adapter load path with malformed GGUFs (the generator of tests/test_fuzz_gguf.py).

    python scripts/fuzz_adapters.py --cases 10000 [--seed N] [--keep DIR]

Writes the tiny test model and valid seed adapters to a temporary folder, then runs CASES mutated
adapters through the same checks as the test: pre-validation, a child process that loads the case
into llama.cpp when it passes, the engine's own load, and the base model's logits afterwards (they
must not move). Unlike the test it does not stop at the first failure: every failing case is kept
under --keep (default: $TMPDIR/loramux-fuzz-failures) and listed at the end. Exit status 1 if any
case failed.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=10000)
    ap.add_argument("--seed", type=int, default=None, help="hypothesis seed (default: random)")
    ap.add_argument("--keep", type=Path, default=None, help="folder for failing cases")
    ap.add_argument("--keep-outcome", action="append", default=[],
                    help="also keep cases with this outcome, e.g. 'refused by load' (repeatable)")
    args = ap.parse_args()
    if args.keep:
        os.environ["LORAMUX_FUZZ_KEEP"] = str(args.keep)

    import gguf_fuzz as gf
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hseed
    from tinymodel import write_tiny_model

    import loramux as lm

    prompt = "the cat sat on the mat and the dog ran"
    with tempfile.TemporaryDirectory(prefix="loramux-fuzz-") as tmp:
        d = Path(tmp)
        base = write_tiny_model(d / "tiny.gguf")
        seeds = gf.seed_docs(gf.write_seeds(d))
        eng = lm.Engine.load(base, n_ctx=256, n_threads=2)
        worker = gf.Worker(base, log=d / "worker.log")
        fz = gf.Fuzzer(eng, worker, d, prompt)
        fz.keep_outcomes = set(args.keep_outcome)
        outcomes: Counter[str] = Counter()
        details: Counter[str] = Counter()
        failures: list[str] = []
        t0 = time.monotonic()

        # generate only: a failure is recorded and the run goes on (no shrinking, no stop)
        @settings(max_examples=args.cases, database=None, deadline=None, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck))
        @given(case=gf.cases(len(seeds)))
        def one(case: tuple) -> None:
            res = fz.run(gf.build(seeds, case), gf.describe(case))
            outcomes[res.outcome] += 1
            details[f"{res.outcome}: {res.detail.split(':')[0] if res.outcome != 'refused' else res.detail}"] += 1
            if res.failure:
                failures.append(res.failure)
                print("FAIL", res.failure, flush=True)
            if fz.n % 500 == 0:
                print(f"{fz.n} cases, {time.monotonic() - t0:.0f} s: {dict(outcomes)}", flush=True)

        try:
            (hseed(args.seed)(one) if args.seed is not None else one)()
        finally:
            worker.close()
            eng.close()
        print(f"\n{fz.n} cases in {time.monotonic() - t0:.0f} s: {dict(outcomes)}")
        for k, n in details.most_common(40):
            print(f"  {n:6d}  {k}")
        print(f"{len(failures)} failing cases" + "".join(f"\n  {f}" for f in failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
