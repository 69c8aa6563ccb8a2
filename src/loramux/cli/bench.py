"""`loramux bench`: prefill, single-stream and N-way decode speed, default vs deterministic mode.

Each mode runs in its own process (ggml reads its kernel switches once per process), on the same
model, adapters and threads; the table shows medians and the deterministic/default ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the engine loads llama.cpp: imported where it is used
    from ..engine.runtime import Engine

PROMPT = "The history of the river valley is long and full of change, and the people who lived there"


def measure(opts: dict[str, Any]) -> dict[str, float]:
    """Runs in the worker process: tokens/s for prefill, one stream, and `parallel` streams."""
    import loramux as lm

    eng = lm.Engine.load(opts["model"], loras=opts["loras"], n_ctx=opts["n_ctx"], n_parallel=opts["parallel"],
                         n_threads=opts["threads"], deterministic=opts["deterministic"], slots=opts["slots"])
    try:
        n, reps = opts["tokens"], opts["repeats"]
        prompt = eng.tokenize(PROMPT * 4)[:n]
        eng.generate(prompt, max_tokens=4, ignore_eos=True)  # warm-up (graph reserve)
        pp, tg, agg = [], [], []
        for _ in range(reps):
            t0 = time.perf_counter()
            eng.generate(prompt, max_tokens=1, ignore_eos=True)
            pp.append(len(prompt) / (time.perf_counter() - t0))
            t0 = time.perf_counter()
            eng.generate(prompt[:8], max_tokens=n, ignore_eos=True)
            tg.append(n / (time.perf_counter() - t0))
            agg.append(_parallel(eng, prompt[:8], n, opts["parallel"]))
        return {"prefill_tok_s": statistics.median(pp), "decode_tok_s": statistics.median(tg),
                "parallel_tok_s": statistics.median(agg)}
    finally:
        eng.close()


def _parallel(eng: Engine, prompt: list[int], n: int, k: int) -> float:
    threads = [threading.Thread(target=eng.generate, args=(prompt,), kwargs={"max_tokens": n, "ignore_eos": True,
                                                                           "seed": i}) for i in range(k)]
    t0 = time.perf_counter()
    [t.start() for t in threads]
    [t.join() for t in threads]
    return k * n / (time.perf_counter() - t0)


def _run_mode(opts: dict[str, Any]) -> dict[str, float]:
    r = subprocess.run([sys.executable, "-m", "loramux.cli.bench", json.dumps(opts)], capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"benchmark worker failed:\n{r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def cmd_bench(args: argparse.Namespace) -> int:
    from ..config import default_model_path

    base = {"model": str(args.model or default_model_path()), "loras": args.lora, "n_ctx": args.n_ctx,
            "parallel": args.parallel, "threads": args.threads, "tokens": args.tokens, "repeats": args.repeats,
            "slots": args.slots}
    modes = ["default"] + (["deterministic"] if not args.no_deterministic else [])
    res = {m: _run_mode({**base, "deterministic": m == "deterministic"}) for m in modes}
    if args.json:
        print(json.dumps(res, indent=2))
        return 0
    keys = [("prefill_tok_s", f"prefill ({args.tokens} tok)"), ("decode_tok_s", "decode, 1 stream"),
            ("parallel_tok_s", f"decode, {args.parallel} streams")]
    print(f"{'tokens/s (median of ' + str(args.repeats) + ')':<28}" + "".join(f"{m:>15}" for m in modes)
          + ("      det/default" if len(modes) == 2 else ""))
    for k, label in keys:
        row = f"{label:<28}" + "".join(f"{res[m][k]:>15.1f}" for m in modes)
        if len(modes) == 2:
            row += f"{res['deterministic'][k] / res['default'][k]:>17.2f}×"
        print(row)
    return 0


def add_parsers(sub: Any) -> None:
    """Register `loramux bench`."""
    p = sub.add_parser("bench", help="measure prefill/decode speed, default vs deterministic mode",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog="example: loramux bench --lora style.gguf --parallel 8")
    p.add_argument("model", nargs="?", default=None, help="base GGUF (default: the embedded Gemma 3 270M)")
    p.add_argument("--lora", action="append", default=[], metavar="SRC[:SCALE]", help="adapter(s) to apply")
    p.add_argument("--parallel", type=int, default=8, help="concurrent streams for the N-way row (default 8)")
    p.add_argument("--slots", type=int, default=0, help="serve adapters through a slot bank of this size")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: all)")
    p.add_argument("--n-ctx", type=int, default=1024, help="context per sequence (default 1024)")
    p.add_argument("--tokens", type=int, default=64, help="prompt and generation length (default 64)")
    p.add_argument("--repeats", type=int, default=3, help="repetitions; medians are shown (default 3)")
    p.add_argument("--no-deterministic", action="store_true", help="only the default mode")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_bench)


if __name__ == "__main__":
    print(json.dumps(measure(json.loads(sys.argv[1]))))


__all__ = ["PROMPT", "add_parsers", "cmd_bench", "measure"]
