"""How long an adapter load stalls a running generation.

    python benchmarks/load_stall.py [--size-mb 100] [--repeats 5] [--before-src OLD_CHECKOUT/src]

A greedy generation streams on the engine while the main thread loads a large F32 adapter
(`--size-mb`, over every projection of the model). Every generated token's time is recorded on
the engine thread; the stall is the longest gap between two tokens while the load runs, minus the
median gap of the same generation outside it (what a token costs anyway).

`--before-src` names the `src/` folder of another loramux checkout (e.g. a commit before a change
to the load path, through `git worktree add`): each round then runs both, in fresh processes and in
alternating order, and the table gives their medians and ratio side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402 - benchmarks/ is not a package


def rank_for(shapes: dict[str, tuple[int, int]], size_mb: float) -> int:
    """The rank whose F32 factors over `shapes` come closest to `size_mb` MiB."""
    per_rank = sum(4 * (o + i) for o, i in shapes.values())
    return max(1, round(size_mb * 2**20 / per_rank))


def worker(args: argparse.Namespace) -> None:
    """One measurement in this process: stream, load the adapter mid-stream, print the timings."""
    import loramux as lm

    eng = lm.Engine.load(args.model, n_ctx=512, n_threads=args.threads)
    try:
        eng.generate("Warm up", max_tokens=4)  # first-decode costs out of the way
        stamps: list[float] = []
        loaded = threading.Event()
        window: list[float] = []

        def on_event(kind: str, _value: object) -> None:
            if kind == "text":
                stamps.append(time.perf_counter())
        req = eng.submit("Once upon a time", max_tokens=args.tokens, ignore_eos=True, on_event=on_event)

        def load() -> None:
            while len(stamps) < args.tokens // 4:
                time.sleep(0.001)
            window.append(time.perf_counter())
            eng.load_lora(args.adapter, "big")
            window.append(time.perf_counter())
            loaded.set()
        t = threading.Thread(target=load)
        t.start()
        while req.events.get(timeout=600)[0] != "done":
            pass
        t.join(600)
        assert loaded.is_set(), "the load did not finish before the generation ended: raise --tokens"
    finally:
        eng.close()
    gaps = [(b - a, a, b) for a, b in zip(stamps, stamps[1:])]
    t0, t1 = window
    during = [g for g, a, b in gaps if b > t0 and a < t1]
    outside = [g for g, a, b in gaps if b <= t0 or a >= t1]
    print(json.dumps({"load_s": t1 - t0, "max_gap_s": max(during, default=0.0),
                      "median_gap_s": C.median(outside), "tokens": len(stamps)}))


def run_one(src: Path | None, args: argparse.Namespace, adapter: Path) -> dict[str, float]:
    env = dict(os.environ)
    if src is not None:
        env["PYTHONPATH"] = str(src) + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, __file__, "--worker", "--adapter", str(adapter), "--tokens", str(args.tokens),
           "--threads", str(args.threads)] + (["--model", str(args.model)] if args.model else [])
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1200)
    if out.returncode != 0:
        raise SystemExit(f"worker failed ({'before' if src else 'this checkout'}):\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    C.common_args(p, repeats=5)
    p.add_argument("--size-mb", type=float, default=100.0, help="adapter size in MiB (default 100)")
    p.add_argument("--tokens", type=int, default=160, help="tokens generated per measurement (default 160)")
    p.add_argument("--before-src", default=None, help="src/ of another checkout to run side by side")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--adapter", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    model = C.model_path(args.model)
    shapes = C.projection_shapes(model)
    rank = rank_for(shapes, args.size_mb)
    from loramux.gguf_io import read_header

    with tempfile.TemporaryDirectory(dir=args.work_dir) as tmp:
        adapter = C.write_random_adapter(Path(tmp) / "big.gguf", read_header(model).architecture, shapes, rank, 1)
        size = adapter.stat().st_size / 2**20
        systems: list[tuple[str, Path | None]] = [("this checkout", None)]
        if args.before_src:
            systems.append(("before", Path(args.before_src).resolve()))
        results: dict[str, list[dict[str, float]]] = {name: [] for name, _ in systems}
        for i in C.progress(range(args.repeats), "rounds"):
            for name, src in (systems if i % 2 == 0 else systems[::-1]):
                results[name].append(run_one(src, args, adapter))
    C.print_machine(C.machine_info(args.threads))
    rows = []
    for name, rs in results.items():
        stall = [r["max_gap_s"] - r["median_gap_s"] for r in rs]
        rows.append([name, C.fmt(C.median(r["load_s"] for r in rs) * 1e3), C.fmt(C.median(stall) * 1e3),
                     C.fmt(C.median(r["max_gap_s"] for r in rs) * 1e3), C.fmt(C.median(r["median_gap_s"] for r in rs) * 1e3)])
    C.print_table(f"Decode stall while loading a {size:.0f} MiB F32 adapter (rank {rank}), medians of "
                  f"{args.repeats} rounds, ms", ["system", "load", "stall", "longest gap", "usual gap"], rows)
    if args.before_src:
        a, b = ([r["max_gap_s"] - r["median_gap_s"] for r in results[n]] for n in ("before", "this checkout"))
        print(f"\nstall before / this checkout: {C.ratio(C.median(a), C.median(b)):.2f}x")
    C.dump_json(args.json, {"size_mb": size, "rank": rank, "results": results})


if __name__ == "__main__":
    main()
