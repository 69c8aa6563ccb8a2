"""Cold adapters: R adapters registered from a `--lora-dir` (1,000 and 10,000), loaded on first use, against one.

Side by side in one run, each `loramux serve` a subprocess on 127.0.0.1 with the same model, threads and
`--parallel`: (1) one adapter loaded with `--lora`, every request on it; (R) R adapter files (hard links of
one rank-r F16 adapter, so the disk holds one) registered with `--lora-dir` and `--max-loaded 64`, requests
drawn by Zipf (s = 1) over all R. Per server: aggregate generated tokens/s (median of --repeats runs, the
same seeded request sequences for each), TTFT p50/p99, the server's RSS after the runs, the longest gap
between two decodes while sequences ran (`loramux_decode_gap_max_seconds`: what cold loads cost the
sequences already decoding), cold loads done, and the server's CPU per decode step and minor page faults
after the warm-up (what the loads cost beside the decodes); for each R, start time minus the one-adapter server's
over R (registration per adapter), an in-process `scan` of the directory, and /v1/models and /metrics
response sizes and latencies.

Also, by default, 8 adapters loaded with `--lora` under the same Zipf traffic (each in its own slot: the
slot bank's own cost, apart from any cold load). Target: ≥ 0.9× the one-adapter throughput at 1,000
registered; decode gap ≤ 1 ms beyond the one-adapter server's.

With `--baseline-src DIR` every server also runs from another loramux tree (right after this tree's), to
measure a change before and after in one run.

    python benchmarks/cold_adapters.py --requests 32 --tokens 16 --repeats 3
    python benchmarks/cold_adapters.py --registered 1000 --unique-prompts --baseline-src ../main/src
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from _common import (
    common_args,
    dump_json,
    machine_info,
    model_path,
    print_machine,
    print_table,
    prompt_openers,
)
from many_adapters import adapter_sequence, bank_figures, link_dir, rss_mb, run_cell, write_adapters
from serve import Server

from loramux.server.lora_dirs import scan

MAX_LOADED = 64


def metric(srv: Server, name: str) -> float:
    for line in httpx.get(srv.url + "/metrics", timeout=30).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return float("nan")


def endpoint(srv: Server, path: str, repeats: int = 5) -> tuple[int, float]:
    """(bytes, median ms) of GET path."""
    sizes, times = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        r = httpx.get(srv.url + path, timeout=60)
        times.append((time.perf_counter() - t0) * 1000)
        sizes.append(len(r.content))
    return sizes[-1], statistics.median(times)


def process_usage(pid: int) -> tuple[float, int]:
    """(CPU seconds, minor page faults) of a process so far, every thread together (Linux; NaN, 0 elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan"), 0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), int(fields[7])


def measured_run(srv: Server, seq: list[int], args: argparse.Namespace) -> dict[str, Any]:
    """One run, with the server's CPU per decode step and its minor page faults, counted after the warm-up
    (what cold loads cost beside the decodes: parse, checks, discovery, fresh memory)."""
    usage: list[tuple[float, int]] = []

    def figures() -> dict[str, float]:
        got = bank_figures(srv)
        usage.append(process_usage(srv.proc.pid))
        return got
    r = run_cell(srv, seq, args.parallel, args.tokens, figures)
    (cpu0, flt0), (cpu1, flt1) = usage[0], usage[-1]
    r["cpu_ms_per_step"] = (cpu1 - cpu0) / max(1.0, r["steps"]) * 1000
    r["page_faults_k"] = (flt1 - flt0) / 1000
    return r


def bench(label: str, argv: list[str], n_adapters: int, args: argparse.Namespace) -> dict[str, Any]:
    srv = Server(argv, "loramux", [])
    srv.unique_prompts = args.unique_prompts
    if args.unique_prompts:
        srv.openers = prompt_openers(model_path(args.model))
    out: dict[str, Any] = {"startup_s": srv.startup}
    try:
        runs = []
        for rep in range(max(1, args.repeats)):
            seq = adapter_sequence(n_adapters, args.requests, "zipf", 1.0, seed=7 + rep)
            srv.unique_seed = rep
            runs.append(measured_run(srv, seq, args))
        runs.sort(key=lambda r: r["tok_s"])
        out.update(runs[(len(runs) - 1) // 2])
        out["all_tok_s"] = [r["tok_s"] for r in runs]
        out["rss_mb"] = rss_mb(srv.proc.pid)
        out["gap_max_ms"] = metric(srv, "loramux_decode_gap_max_seconds") * 1000
        out["gap_p99_ms"] = metric(srv, "loramux_decode_gap_p99_seconds") * 1000
        out["evictions"] = metric(srv, "loramux_adapter_evictions_total")
        out["models"] = endpoint(srv, "/v1/models")
        out["metrics"] = endpoint(srv, "/metrics")
        print(f"{label}: {out['tok_s']:.1f} tok/s {out['all_tok_s']}", file=sys.stderr)
    finally:
        srv.close()
    return out


def profile_load(model: Path, path: str, threads: int, repeats: int) -> list[list[str]]:
    """In one process: where a cold load's time goes, per part (median ms of `repeats`): the parse and checks,
    llama.cpp's adapter load, the tensor discovery (a graph built on a context of its own), all on the
    loading thread as `LoRAAdapter` does them, and the free at eviction; against one decode step of 8
    sequences."""
    from loramux import _native as N
    from loramux.engine.adapters import CheckedAdapter, LoRAAdapter
    from loramux.engine.runtime import Engine
    from loramux.engine.streams import TextStream

    parts: dict[str, list[float]] = {k: [] for k in ("parse", "llama.cpp load", "discovery", "free")}
    with Engine.load(model, n_ctx=256, n_parallel=8, n_threads=threads) as eng:
        for _ in range(repeats):
            t0 = time.perf_counter()
            checked = CheckedAdapter(eng.model, path)
            t1 = time.perf_counter()
            handle = N.AdapterHandle.load(eng.model.handle, checked.pin.native_path)
            t2 = time.perf_counter()
            handle.close()
            checked.close()
            a = LoRAAdapter(eng.model, CheckedAdapter(eng.model, path), "p")  # parse + load + discovery
            t3 = time.perf_counter()
            a.close()
            t4 = time.perf_counter()
            parts["parse"].append(t1 - t0)
            parts["llama.cpp load"].append(t2 - t1)
            parts["discovery"].append(max(0.0, (t3 - t2) - (t2 - t0)))
            parts["free"].append(t4 - t3)
        eng.load_lora(path, "d")
        steps = []
        for _ in range(3):
            futs = [eng.submit_async("The quick brown fox", loras={"d": 1.0}, max_tokens=16, ignore_eos=True)
                    for _ in range(8)]
            t0, n0 = time.perf_counter(), eng.stats().decode_steps
            for f in futs:
                TextStream(f.result()).consume()
            steps.append((time.perf_counter() - t0) / max(1, eng.stats().decode_steps - n0))
    rows = [[k, f"{statistics.median(v) * 1000:.2f}"] for k, v in parts.items()]
    rows.append(["one decode step, 8 sequences (for scale)", f"{statistics.median(steps) * 1000:.2f}"])
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common_args(ap, repeats=3)
    ap.add_argument("--registered", default="1000,10000", help="adapters registered cold (default 1000,10000)")
    ap.add_argument("--parallel", type=int, default=8, help="server slots and requests in flight (default 8)")
    ap.add_argument("--requests", type=int, default=32, help="requests per run (default 32)")
    ap.add_argument("--tokens", type=int, default=16, help="generated tokens per request (default 16)")
    ap.add_argument("--rank", type=int, default=8, help="adapter rank (default 8)")
    ap.add_argument("--loaded-reference", type=int, default=8,
                    help="also a server with this many adapters loaded with --lora and Zipf over them, every one "
                         "in a slot: the slot bank's own cost, apart from cold loads (0: none; default 8)")
    ap.add_argument("--unique-prompts", action="store_true",
                    help="every request's prompt starts with its own one-token word (after BOS), so no "
                         "request reuses another's KV cache (by default 4 prompts repeat, and the servers with "
                         "fewer adapters reuse more)")
    ap.add_argument("--bank-dtypes", default="f32",
                    help="the bank's factor types to run the banked servers with, side by side (f32, f16 or "
                         "f32,f16; default f32, what serve uses)")
    ap.add_argument("--server-args", default="", metavar="OPTIONS",
                    help="more `loramux serve` options for every server, e.g. \"--background-nice 0\"")
    ap.add_argument("--baseline-src", default=None, metavar="DIR",
                    help="also run every server from another loramux tree (its src directory, e.g. a checkout of "
                         "main), each right after this tree's, and print both side by side")
    ap.add_argument("--profile-load", action="store_true",
                    help="only time the parts of one cold load in process (parse, llama.cpp load, discovery, free)")
    args = ap.parse_args()
    counts = [int(c) for c in args.registered.split(",") if c]
    model = model_path(args.model)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="loramux-cold-"))
    work.mkdir(parents=True, exist_ok=True)
    one = write_adapters(work, model, 1, args.rank)[0]
    if args.profile_load:
        print_machine(machine_info(args.threads))
        print_table(f"one cold load of a rank-{args.rank} F16 adapter, in process (median ms of {max(5, args.repeats)})",
                    ["part", "ms"], profile_load(model, one, args.threads, max(5, args.repeats)))
        return
    dirs = {n: link_dir(work, one, n) for n in counts}
    info = machine_info(args.threads)
    print_machine(info)
    common = [sys.executable, "-m", "loramux", "serve", str(model), "--n-ctx", "512", "--threads",
              str(args.threads), "--parallel", str(args.parallel), "--public-metrics", *shlex.split(args.server_args)]
    res: dict[str, Any] = {}

    def run(key: str, label: str, argv: list[str], n: int) -> None:
        res[key] = bench(label, argv, n, args)
        if args.baseline_src:  # the same server from the other tree, right after
            res[f"{key}@baseline"] = bench(f"{label} (baseline)", ["env", f"PYTHONPATH={args.baseline_src}", *argv],
                                           n, args)

    run("1", "1 adapter", [*common, "--lora", f"a0={one}"], 1)
    dtypes = [d for d in args.bank_dtypes.split(",") if d]
    ref = link_dir(work, one, args.loaded_reference) if args.loaded_reference else None
    scans = {}
    for dt in dtypes:
        banked = [*common, "--bank-dtype", dt]
        if ref is not None:  # every adapter loaded and in a slot: what the slot bank alone costs
            run(f"loaded/{dt}", f"{args.loaded_reference} loaded, {dt} bank", [*banked, *[
                x for k in range(args.loaded_reference) for x in ("--lora", f"a{k}={ref / f'a{k}.gguf'}")]],
                args.loaded_reference)
        for n in counts:
            t0 = time.perf_counter()
            scan([str(dirs[n])])
            scans[n] = (time.perf_counter() - t0) / n * 1e6
            run(f"{n}/{dt}", f"{n} registered, {dt} bank", [*banked, "--lora-dir", str(dirs[n]),
                                                             "--max-loaded", str(MAX_LOADED)], n)
    report(res, counts, dtypes, scans, args)
    if args.baseline_src:
        report_baseline(res, args)
    info["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    print(f"load average at the end: {info['loadavg_end']}")
    dump_json(args.json, {"machine": info, "results": res, "scan_us": scans, "args": vars(args)})


def report(res: dict[str, Any], counts: list[int], dtypes: list[str], scans: dict[int, float],
           args: argparse.Namespace) -> None:
    base = res["1"]
    rows = []
    keys = ["1"] + [k for dt in dtypes for k in [f"loaded/{dt}", *(f"{n}/{dt}" for n in counts)] if k in res]
    for key in keys:
        r = res[key]
        what, _, dt = key.partition("/")
        label = "1" if key == "1" else (f"{args.loaded_reference} (--lora, all in slots)" if what == "loaded"
                                        else f"{int(what):,} (--lora-dir)") + (f", {dt} bank" if len(dtypes) > 1 else "")
        rows.append([label, f"{r['tok_s']:.1f}",
                     f"{r['tok_s'] / base['tok_s']:.2f}", f"{r['ttft_p50']:.2f} / {r['ttft_p99']:.2f}",
                     f"{r['gap_max_ms']:.1f} / {r['gap_p99_ms']:.1f}", f"{r['evictions']:.0f}",
                     f"{r['rss_mb']:.0f}", f"{r['startup_s']:.2f}",
                     f"{r['steps']:.0f} / {r['ms_per_step']:.0f} / {r['tokens_per_step']:.1f}",
                     f"{r['cpu_ms_per_step']:.0f} / {r['page_faults_k']:.0f}"])
    print_table(f"Zipf (s = 1) over the registered adapters: {args.parallel} streams, {args.requests} requests × "
                f"{args.tokens} tokens, {args.threads} threads, rank-{args.rank} adapters, --max-loaded {MAX_LOADED} "
                f"(median of {args.repeats} runs{', unique prompts' if args.unique_prompts else ', 4 prompts repeating'})",
                ["adapters", "tokens/s", "vs 1 adapter", "TTFT p50 / p99 (s)", "decode gap max / p99 (ms)",
                 "evictions", "RSS (MB)", "start (s)", "decode steps / ms per step / tokens per step",
                 "server CPU ms per step / page faults (k)"], rows)
    rows = []
    for n in counts:
        r = res[f"{n}/{dtypes[0]}"]
        rows.append([f"{n:,}", f"{(r['startup_s'] - base['startup_s']) / n * 1e6:.0f}", f"{scans[n]:.1f}",
                     f"{r['models'][0] / 1e3:.0f} kB, {r['models'][1]:.1f} ms",
                     f"{r['metrics'][0] / 1e3:.0f} kB, {r['metrics'][1]:.1f} ms"])
    if rows:  # (--registered "": only the one-adapter and all-in-slots servers)
        print_table("registration and listing", ["registered", "start time over 1 adapter's, per adapter (µs)",
                                                 "scan per adapter, in process (µs)", "GET /v1/models",
                                                 "GET /metrics"], rows)


def report_baseline(res: dict[str, Any], args: argparse.Namespace) -> None:
    """--baseline-src: each server from both trees, and each against its own tree's one-adapter server."""
    rows = []
    for key in [k for k in res if not k.endswith("@baseline") and f"{k}@baseline" in res]:
        new, old = res[key], res[f"{key}@baseline"]
        rows.append([key, f"{old['tok_s']:.1f}", f"{new['tok_s']:.1f}", f"{new['tok_s'] / old['tok_s']:.2f}",
                     f"{old['tok_s'] / res['1@baseline']['tok_s']:.2f}", f"{new['tok_s'] / res['1']['tok_s']:.2f}",
                     f"{old['ttft_p50']:.2f} / {new['ttft_p50']:.2f}", f"{old['ttft_p99']:.2f} / {new['ttft_p99']:.2f}",
                     f"{old['steps']:.0f} / {new['steps']:.0f}",
                     f"{old['cpu_ms_per_step']:.0f} / {new['cpu_ms_per_step']:.0f}",
                     f"{old['page_faults_k']:.0f} / {new['page_faults_k']:.0f}"])
    print_table(f"this tree against {args.baseline_src} (each run right after this tree's; medians of {args.repeats})",
                ["server", "baseline tok/s", "this tok/s", "this / baseline", "baseline vs its 1 adapter",
                 "this vs its 1 adapter", "TTFT p50 (s), baseline / this", "TTFT p99 (s), baseline / this",
                 "decode steps, baseline / this", "server CPU ms per step, baseline / this",
                 "page faults (k), baseline / this"], rows)


if __name__ == "__main__":
    main()
