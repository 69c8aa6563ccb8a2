"""Fan-out over 8 adapter sets against 8 separate concurrent requests, side by side in one run.

One loramux server (in this process, on 127.0.0.1; --parallel 8, an 8-slot bank) with 8 random rank-8
adapters. Each repeat sends, interleaved: one streamed completion with `adapter_sets` naming the 8 adapters
(fan-out, server/fanout.py), and 8 streamed completions at once, one per adapter, from 8 threads. Both
generate the same tokens (greedy, ignore_eos, the same prompt). Reported: the aggregate generated tokens
per second (all tokens over the wall time from the first byte sent to the last token received), the wall
time to the last token, and the fan-out's ratio to the separate requests.

    python benchmarks/fanout.py [--model M.gguf] [--repeats 5] [--tokens 64] [--sets 8]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
from _common import (
    common_args,
    machine_info,
    median,
    model_path,
    print_machine,
    print_table,
    projection_shapes,
    write_random_adapter,
)

PROMPT = "Write a short story about a lighthouse keeper who"


def stream(url: str, body: dict[str, Any]) -> tuple[float, int]:
    """(time the last token arrived, generated tokens) of one streamed completion."""
    tokens, last = 0, time.perf_counter()
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for ln in r.iter_lines():
            if not ln.startswith("data: ") or ln == "data: [DONE]":
                continue
            ev = json.loads(ln[6:])
            if any(c.get("text") for c in ev.get("choices", [])):
                last = time.perf_counter()
            if ev.get("usage"):
                tokens = ev["usage"]["completion_tokens"]
    return last, tokens


def body(n: int, **extra: Any) -> dict[str, Any]:
    return {"prompt": PROMPT, "max_tokens": n, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, **extra}


def fanout(url: str, names: list[str], n: int) -> tuple[float, int]:
    """(wall time to the last token, tokens) of one fan-out request over every adapter."""
    t0 = time.perf_counter()
    last, tokens = stream(url, body(n, adapter_sets=[{"lora": [{"name": a}]} for a in names]))
    return last - t0, tokens


def separate(url: str, names: list[str], n: int, pool: ThreadPoolExecutor) -> tuple[float, int]:
    """(wall time to the last token of any, tokens) of one request per adapter, sent at once."""
    t0 = time.perf_counter()
    done = list(pool.map(lambda a: stream(url, body(n, model=a)), names))
    return max(last for last, _ in done) - t0, sum(t for _, t in done)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common_args(ap, repeats=5)
    ap.add_argument("--tokens", type=int, default=64, help="tokens per adapter set (default 64)")
    ap.add_argument("--sets", type=int, default=8, help="adapter sets (default 8)")
    args = ap.parse_args()
    import loramux as lm
    from loramux.server import ServerSettings, create_app, serve_in_thread

    model = model_path(args.model)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="loramux-fanout-"))
    k = args.sets
    eng = lm.Engine.load(model, n_ctx=2048 * k, n_parallel=k, n_threads=args.threads, slots=k, slot_rank=8)
    shapes = projection_shapes(model)
    names = [f"ad{i}" for i in range(k)]
    for i, name in enumerate(names):
        eng.load_lora(write_random_adapter(work / f"{name}.gguf", eng.model.architecture, shapes, 8, i), name)
    print_machine(machine_info(args.threads))
    runs: dict[str, list[tuple[float, int]]] = {"fan-out": [], "separate": []}
    with serve_in_thread(create_app(eng, ServerSettings(parallel=k), own_engine=True)) as srv, \
            ThreadPoolExecutor(k) as pool:
        fanout(srv.url, names, 4)  # warm-up: the slots, the prompt, the graphs
        separate(srv.url, names, 4, pool)
        for _ in range(args.repeats):
            runs["fan-out"].append(fanout(srv.url, names, args.tokens))
            runs["separate"].append(separate(srv.url, names, args.tokens, pool))
    rate = {m: median(t / w for w, t in r) for m, r in runs.items()}
    wall = {m: median(w for w, _ in r) for m, r in runs.items()}
    rows = [[m, str(runs[m][0][1]), f"{rate[m]:.1f}", f"{wall[m]:.2f}", f"{rate[m] / rate['separate']:.2f}×",
             f"{wall[m] / wall['separate']:.2f}×"] for m in runs]
    print_table(f"{k} adapter sets × {args.tokens} tokens, {args.repeats} repeats interleaved (medians)",
                ["mode", "tokens", "aggregate tok/s", "wall to last token (s)", "tok/s vs separate",
                 "wall vs separate"], rows)


if __name__ == "__main__":
    main()
