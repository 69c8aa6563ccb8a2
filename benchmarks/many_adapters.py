"""Serving many adapters: 1 to 256 distinct adapters over 8 streams, loramux serve vs llama-server.

Both servers run as subprocesses on 127.0.0.1 with the same model, threads and parallel slots and
the same N rank-r adapters over every projection (loramux: `--lora` each, default bank sizing;
llama-server: `--lora` with all of them, each request naming its adapter in `lora`). A load
generator keeps `--parallel` streaming requests in flight; each picks its adapter uniformly or by a
Zipf law (p_k ∝ 1/(k+1)^s) from a seeded generator, so both servers get the same sequence.
Reported per cell: aggregate generated tokens/s, p50/p99 request latency, p50/p99 time to first
token, and for loramux its slot wait p99 (from /metrics) and the server's RSS before and after.

Target (issue 21): loramux with 64 adapters ≥ 0.8× its own one-adapter throughput. With 256 adapters
over the 8 slots: ≥ 0.95× the throughput of 8 adapters (all in slots, never rewritten: `--reference`),
TTFT p50 ≤ 1.3× and p99 ≤ 3× it. Also per cell: the most decode steps a request waited for a slot,
and the share of decodes that went through the bank's masks (the rest ran one adapter set natively).

    python benchmarks/many_adapters.py                      # needs benchmarks/build_peers.sh
    python benchmarks/many_adapters.py --counts 1,4,16 --no-llama-server --requests 16
    python benchmarks/many_adapters.py --counts 8,256 --no-llama-server --requests 24 --tokens 16 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from _common import (
    REPO_ROOT,
    common_args,
    dump_json,
    machine_info,
    model_path,
    peer_binary,
    print_machine,
    print_table,
    projection_shapes,
    prompt_openers,
    random_factors,
)
from serve import RUN_STRIDE, Server

from loramux.gguf_io import read_header, write_adapter


def adapter_sequence(n_adapters: int, n_requests: int, dist: str, s: float, seed: int) -> list[int]:
    """Which adapter each request uses: uniform, or Zipf with exponent s over adapter ranks."""
    rng = np.random.default_rng(seed)
    if dist == "uniform":
        return [int(x) for x in rng.integers(0, n_adapters, n_requests)]
    p = 1.0 / np.arange(1, n_adapters + 1) ** s
    return [int(x) for x in rng.choice(n_adapters, n_requests, p=p / p.sum())]


def rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def one_request(srv: Server, i: int, adapter: int, n_tokens: int) -> tuple[float, float, int]:
    """(latency, time to first token, generated tokens) of one streaming request."""
    body = {**srv.body(i, adapter, n_tokens), "stream": True}
    t0 = time.perf_counter()
    ttft, n = float("nan"), 0
    with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=900) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            choice = (chunk.get("choices") or [{}])[0]
            if choice.get("text") and ttft != ttft:
                ttft = time.perf_counter() - t0
            if choice.get("finish_reason") == "length":
                n = n_tokens  # ignore_eos + max_tokens: exactly n_tokens were generated
    return time.perf_counter() - t0, ttft, n


def run_cell(srv: Server, seq: list[int], parallel: int, n_tokens: int,
             figures: Callable[[], dict[str, float]] | None = None) -> dict[str, float]:
    """One run of the requests `seq` (adapter per request), `parallel` in flight, after a warm-up of one each;
    with `figures`, its readings after the warm-up and at the end become the run's work (`work_figures`)."""
    with ThreadPoolExecutor(parallel) as ex:
        # warm-up, with request numbers no run uses (a unique prompt of the run would reuse its whole KV)
        list(ex.map(lambda k: one_request(srv, RUN_STRIDE - 1 - k, seq[k % len(seq)], 4), range(parallel)))
        start = figures() if figures is not None else None
        t0 = time.perf_counter()
        res = list(ex.map(lambda i: one_request(srv, i, seq[i], n_tokens), range(len(seq))))
        wall = time.perf_counter() - t0
    lat = sorted(x for x, _, _ in res)
    ttft = sorted(x for _, x, _ in res if x == x)

    def q(xs: list[float], p: float) -> float:
        return xs[min(len(xs) - 1, int(p * len(xs)))] if xs else float("nan")
    out = {"tok_s": sum(n for _, _, n in res) / wall, "p50": q(lat, 0.5), "p99": q(lat, 0.99),
           "ttft_p50": q(ttft, 0.5), "ttft_p99": q(ttft, 0.99), "wall": wall, "distinct": len(set(seq))}
    if start is not None:
        out.update(work_figures(start, figures(), wall, len(seq)))
    return out


BANK_FIGURES = ("loramux_slot_wait_p99_seconds", "loramux_slot_wait_max_steps", "loramux_decode_steps_total",
                "loramux_bank_decodes_total", "llamacpp:prompt_tokens_total", "llamacpp:tokens_predicted_total")


BASELINE = "loramux (baseline)"
COLD_MAX_LOADED = 64  # --max-loaded of the servers with adapters registered cold


def bank_figures(srv: Server) -> dict[str, float]:
    """loramux's slot-wait gauges and decode counters from /metrics (NaN where absent)."""
    out = dict.fromkeys(BANK_FIGURES, float("nan"))
    try:
        text = httpx.get(srv.url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return out
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in out:
            out[name] = float(value)
    return out


def work_figures(before: dict[str, float], after: dict[str, float], wall: float, n_requests: int
                 ) -> dict[str, float]:
    """One run's engine work from /metrics deltas: decode steps (and those through the bank), prompt tokens evaluated (cached ones are not
    counted) per request, all tokens (prompt evaluated and generated) per step and per second. A server that
    reuses fewer prompt prefixes evaluates more prompt tokens for the same generated ones: these say whether a
    slower server did more work or did the same work more slowly."""
    steps, banked, prompt, gen = (after[k] - before[k] for k in (
        "loramux_decode_steps_total", "loramux_bank_decodes_total", "llamacpp:prompt_tokens_total",
        "llamacpp:tokens_predicted_total"))
    return {"steps": steps, "bank_decodes": banked, "prompt_per_request": prompt / n_requests,
            "ms_per_step": wall / steps * 1000 if steps else float("nan"),
            "tokens_per_step": (prompt + gen) / steps if steps else float("nan"),
            "work_tok_s": (prompt + gen) / wall}


def write_adapters(work: Path, model: Path, n: int, rank: int) -> list[str]:
    shapes = projection_shapes(model)
    arch = read_header(model).architecture or "?"
    out = []
    for k in range(n):
        p = work / f"a{k}.gguf"
        if not p.exists():  # F16 files (half the disk); alpha = rank so llama.cpp's alpha/rank is 1
            write_adapter(p, arch, random_factors(shapes, rank, 100 + k), float(rank), dtype="f16")
        out.append(str(p))
    return out


def link_dir(work: Path, one: str, n: int) -> Path:
    """A directory of n hard links to one adapter file, named a0.gguf … a{n-1}.gguf (for `--lora-dir`)."""
    d = work / f"reg{n}"
    d.mkdir(exist_ok=True)
    for k in range(n):
        p = d / f"a{k}.gguf"
        if not p.exists():
            os.link(one, p)
    return d


def bench_systems(systems: list[tuple[str, list[str], str]], adapters: list[str], args: argparse.Namespace
                  ) -> dict[str, dict[str, Any]]:
    """Start every (label, argv, kind) server, then run each cell on each in turn, repeat by repeat, so
    systems compared side by side share the machine's load; the median repeat per cell (by tokens/s)."""
    out: dict[str, dict[str, Any]] = {}
    live: list[tuple[str, str, Server]] = []
    try:
        for label, argv, kind in systems:
            try:
                srv = Server(argv, kind, adapters, start_timeout=args.start_timeout)
            except SystemExit as e:  # e.g. llama-server refusing this many adapters
                print(f"{label} with {len(adapters)} adapters did not start: {e}", file=sys.stderr)
                out[label] = {"failed": str(e)}
                continue
            srv.unique_prompts = args.unique_prompts
            if args.unique_prompts:
                srv.openers = prompt_openers(model_path(args.model))
            live.append((label, kind, srv))
            out[label] = {"startup_s": srv.startup, "rss_start_mb": rss_mb(srv.proc.pid)}
        for d, dist in enumerate(args.dists):
            runs: dict[str, list[dict[str, float]]] = {label: [] for label, _, _ in live}
            for rep in range(max(1, args.repeats)):
                seq = adapter_sequence(len(adapters), args.requests, dist, args.zipf_s, seed=7 + rep)
                for label, kind, srv in live:
                    srv.unique_seed = d * max(1, args.repeats) + rep  # no prompt repeats across runs
                    figures = (lambda s=srv: bank_figures(s)) if kind == "loramux" else None
                    runs[label].append(run_cell(srv, seq, args.parallel, args.tokens, figures))
            for label, kind, srv in live:
                rs = sorted(runs[label], key=lambda r: r["tok_s"])
                cell = out[label][dist] = {**rs[(len(rs) - 1) // 2], "all_tok_s": [r["tok_s"] for r in rs],
                                           "all_ttft_p50": sorted(r["ttft_p50"] for r in rs),
                                           "all_ttft_p99": sorted(r["ttft_p99"] for r in rs),
                                           "all_work_tok_s": [r.get("work_tok_s", float("nan")) for r in rs]}
                if kind == "loramux":  # gauges over recent waits; the bank's share of the runs' decode steps
                    after, steps = bank_figures(srv), sum(r["steps"] for r in rs)
                    cell.update(slot_wait_p99=after["loramux_slot_wait_p99_seconds"],
                                slot_wait_max_steps=after["loramux_slot_wait_max_steps"],
                                bank_share=sum(r["bank_decodes"] for r in rs) / steps if steps else float("nan"))
                print(f"{label}, {len(adapters)} adapters, {dist}: {cell['tok_s']:.1f} tok/s", file=sys.stderr)
        for label, _, srv in live:
            out[label]["rss_end_mb"] = rss_mb(srv.proc.pid)
    finally:
        for _, _, srv in live:
            srv.close()
    return out


def slot_loads(model: Path, work: Path, ranks: list[int], threads: int, repeats: int) -> list[list[str]]:
    """In one process: a slot write of a loaded adapter prepared from scratch (read back, pad, scale,
    check, copy) against one from the warm tier (the copy alone), per adapter rank; median and p90 ms."""
    from loramux.engine.runtime import Engine

    rows = []
    for rank in ranks:
        files = [work / f"slot-r{rank}-{k}.gguf" for k in range(2)]
        shapes, arch = projection_shapes(model), read_header(model).architecture or "?"
        for k, p in enumerate(files):
            if not p.exists():
                write_adapter(p, arch, random_factors(shapes, rank, 900 + k), float(rank), dtype="f32")
        with Engine.load(model, n_ctx=256, n_parallel=1, n_threads=threads, slots=1, slot_rank=rank) as eng:
            ads = [eng.load_lora(str(p), name=p.stem) for p in files]
            cold = eng.call(lambda ads=ads: _time_slot_loads(eng.bank, ads, repeats, warm=False))
            warm = eng.call(lambda ads=ads: _time_slot_loads(eng.bank, ads, repeats, warm=True))
            size = eng.bank.prepare(ads[0]).nbytes
        rows.append([str(rank), f"{size / 1e6:.1f}", f"{cold[len(cold) // 2]:.2f}", f"{warm[len(warm) // 2]:.2f}",
                     f"{warm[int(0.9 * len(warm))]:.2f}", f"{cold[len(cold) // 2] / warm[len(warm) // 2]:.1f}×"])
    return rows


def _time_slot_loads(bank: Any, ads: list[Any], repeats: int, warm: bool) -> list[float]:
    """ms of each slot load: one slot, two adapters taking turns, so every acquire writes the slot."""
    out = []
    for i in range(repeats):
        a = ads[i % 2]
        if not warm:
            bank.warm.discard(a)
        t0 = time.perf_counter()
        k = bank.take_slot(a)
        out.append((time.perf_counter() - t0) * 1000)
        bank.return_slot(k)
    return sorted(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common_args(ap, repeats=1)
    ap.add_argument("--counts", default="1,4,16,64,256", help="numbers of distinct adapters (default 1,4,16,64,256)")
    ap.add_argument("--dists", default="uniform,zipf", help="request distributions (default uniform,zipf)")
    ap.add_argument("--zipf-s", type=float, default=1.0, help="Zipf exponent (default 1.0)")
    ap.add_argument("--parallel", type=int, default=8, help="server slots and requests in flight (default 8)")
    ap.add_argument("--requests", type=int, default=32, help="requests per cell (default 32)")
    ap.add_argument("--tokens", type=int, default=32, help="generated tokens per request (default 32)")
    ap.add_argument("--rank", type=int, default=8, help="adapter rank (default 8)")
    ap.add_argument("--reference", type=int, default=8,
                    help="the count the ratios are taken against when it is in --counts (default 8: with the "
                         "default bank of --parallel slots, every adapter in its own slot, never rewritten)")
    ap.add_argument("--no-llama-server", action="store_true", help="skip the llama-server peer")
    ap.add_argument("--unique-prompts", action="store_true",
                    help="every request's prompt starts with its own one-token word (after BOS), so no "
                         "request reuses another's KV cache (by default 4 prompts repeat, and a server with "
                         "fewer adapters reuses more)")
    ap.add_argument("--cold-from", type=int, default=1000,
                    help="counts from this one up are registered cold with --lora-dir (hard links of one adapter) "
                         f"and --max-loaded {COLD_MAX_LOADED}, not loaded with --lora (default 1000)")
    ap.add_argument("--llama-server-max", type=int, default=256,
                    help="the largest count llama-server is run with (it loads every adapter at start; default 256)")
    ap.add_argument("--start-timeout", type=float, default=300,
                    help="seconds a server may take to load its adapters and listen (default 300)")
    ap.add_argument("--baseline-src", default=None,
                    help="also serve from this source tree (a `src` folder of another loramux checkout) beside "
                         "this one, cell by cell and repeat by repeat, and print both side by side")
    ap.add_argument("--server-args", default="", metavar="OPTIONS",
                    help="extra `loramux serve` options for this tree's server, e.g. '--bank-dtype f16'; with "
                         "them and no --baseline-src, this tree with its defaults is the baseline")
    ap.add_argument("--baseline-args", default="", metavar="OPTIONS",
                    help="extra `loramux serve` options for the baseline server, e.g. '--slot-writes inline' "
                         "(with --server-args '--slot-writes background': the two modes side by side)")
    ap.add_argument("--plot", default=str(REPO_ROOT / "benchmarks" / "results" / "many_adapters.png"),
                    help="where to write the throughput plot ('' = none)")
    ap.add_argument("--slot-loads", action="store_true",
                    help="only time slot loads from the loaded and the warm tier (in process), then exit")
    args = ap.parse_args()
    if args.slot_loads:
        work = Path(args.work_dir or tempfile.mkdtemp(prefix="loramux-many-"))
        work.mkdir(parents=True, exist_ok=True)
        print_machine(machine_info(args.threads))
        rows = slot_loads(model_path(args.model), work, [8, 16], args.threads, max(20, args.repeats))
        print_table("slot load of one adapter over all 126 projections (ms; F32 bank, slot rank = adapter rank)",
                    ["rank", "warm blocks (MB)", "prepared (loaded tier)", "from warm, median", "from warm, p90",
                     "speed-up"], rows)
        return
    args.dists = [d for d in args.dists.split(",") if d]
    counts = [int(c) for c in args.counts.split(",") if c]
    model = model_path(args.model)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="loramux-many-"))
    work.mkdir(parents=True, exist_ok=True)
    all_adapters = write_adapters(work, model, max([1] + [c for c in counts if c < args.cold_from]), args.rank)
    info = machine_info(args.threads)
    print_machine(info)
    common = ["--n-ctx", "512", "--threads", str(args.threads), "--parallel", str(args.parallel)]
    results: dict[str, dict[int, Any]] = {"loramux": {}, "llama-server": {}, BASELINE: {}}
    for n in counts:
        ads = all_adapters[:n] if n < args.cold_from else [f"a{k}" for k in range(n)]
        loras = [x for k, a in enumerate(ads) for x in ("--lora", f"a{k}={a}")] if n < args.cold_from else [
            "--lora-dir", str(link_dir(work, all_adapters[0], n)), "--max-loaded", str(COLD_MAX_LOADED)]
        serve = ["-m", "loramux", "serve", str(model), *common, "--public-metrics", *loras]
        systems = [("loramux", [sys.executable, *serve, *shlex.split(args.server_args)], "loramux")]
        if args.baseline_src or args.server_args:  # another tree or other options, run beside this one
            env = ["env", f"PYTHONPATH={args.baseline_src}"] if args.baseline_src else []
            systems.append((BASELINE, [*env, sys.executable, *serve, *shlex.split(args.baseline_args)], "loramux"))
        got = bench_systems(systems, ads, args)
        for label in got:
            results[label][n] = got[label]
        if not args.no_llama_server and n <= args.llama_server_max:
            ls = [str(peer_binary("llama-server")), "-m", str(model), "-t", str(args.threads), "-np",
                  str(args.parallel), "-c", str(512 * args.parallel), "--no-webui", "--lora", ",".join(ads)]
            results["llama-server"][n] = bench_systems([("llama-server", ls, "llama-server")], ads, args)["llama-server"]
    report(results, counts, args)
    if args.baseline_src or args.server_args:
        report_baseline(results, counts, args)
    if args.plot:
        plot(results, counts, args, Path(args.plot))
    dump_json(args.json, {"machine": info, "results": results, "args": vars(args)})


def _cell(r: dict[str, Any] | None, dist: str) -> dict[str, Any] | None:
    return r.get(dist) if r and "failed" not in r else None


def _med(xs: list[float]) -> float:
    return float(np.median(xs)) if xs else float("nan")


def report(results: dict[str, dict[int, Any]], counts: list[int], args: argparse.Namespace) -> None:
    ref_n = args.reference if args.reference in counts else counts[0]
    for dist in args.dists:
        one = _cell(results["loramux"].get(ref_n), dist)
        rows = []
        for n in counts:
            lm, ls = _cell(results["loramux"].get(n), dist), _cell(results["llama-server"].get(n), dist)
            rows.append([str(n), f"{lm['tok_s']:.1f}" if lm else "-",
                         f"{_med(lm['all_tok_s']) / _med(one['all_tok_s']):.2f}" if lm and one else "-",
                         f"{_med(lm['all_ttft_p50']) / _med(one['all_ttft_p50']):.2f} / "
                         f"{_med(lm['all_ttft_p99']) / _med(one['all_ttft_p99']):.2f}" if lm and one else "-",
                         f"{ls['tok_s']:.1f}" if ls else "-",
                         f"{lm['tok_s'] / ls['tok_s']:.2f}×" if lm and ls else "-",
                         f"{lm['p50']:.2f} / {lm['p99']:.2f}" if lm else "-",
                         f"{ls['p50']:.2f} / {ls['p99']:.2f}" if ls else "-",
                         f"{lm['ttft_p50']:.2f} / {lm['ttft_p99']:.2f}" if lm else "-",
                         f"{ls['ttft_p50']:.2f} / {ls['ttft_p99']:.2f}" if ls else "-",
                         f"{lm['slot_wait_p99'] * 1000:.0f} ms" if lm and lm.get("slot_wait_p99") == lm.get(
                             "slot_wait_p99") else "-",
                         f"{lm.get('slot_wait_max_steps', float('nan')):.0f}" if lm else "-",
                         f"{lm.get('bank_share', float('nan')):.2f}" if lm else "-"])
        print_table(f"{dist} requests{f' (s = {args.zipf_s:g})' if dist == 'zipf' else ''}: {args.parallel} "
                    f"streams, {args.requests} requests × {args.tokens} tokens, {args.threads} threads, "
                    f"rank-{args.rank} adapters (aggregate tokens/s; latency and TTFT p50 / p99 in s; ratios "
                    f"of medians over {max(1, args.repeats)} repeats against {ref_n} adapters; "
                    f"{'unique prompts' if args.unique_prompts else '4 prompts repeating'})",
                    ["adapters", "loramux", f"tok/s vs {ref_n}", f"TTFT p50 / p99 vs {ref_n}", "llama-server",
                     "loramux / llama-server", "loramux latency", "llama-server latency", "loramux TTFT",
                     "llama-server TTFT", "loramux slot wait p99", "slot wait max steps", "bank decodes"], rows)
        work_table(results["loramux"], counts, ref_n, dist)
    rows = []
    for n in counts:
        lm, ls = results["loramux"].get(n) or {}, results["llama-server"].get(n) or {}
        rows.append([str(n), f"{lm.get('rss_start_mb', float('nan')):.0f}", f"{lm.get('rss_end_mb', float('nan')):.0f}",
                     f"{ls.get('rss_start_mb', float('nan')):.0f}" if ls else "-",
                     f"{ls.get('rss_end_mb', float('nan')):.0f}" if ls else "-"])
    print_table("server RSS (MB): after start with N adapters loaded, and after the runs",
                ["adapters", "loramux start", "loramux end", "llama-server start", "llama-server end"], rows)


def work_table(res: dict[int, Any], counts: list[int], ref_n: int, dist: str) -> None:
    """loramux's engine work per count (the median run's /metrics deltas): prompt tokens evaluated per request,
    decode steps, tokens per step, and all tokens (prompt evaluated and generated) per second against the
    reference: a ratio near 1 there with a lower tokens/s ratio means the same engine speed spent on more
    prompt tokens (prefixes not reused), not a slower engine."""
    one, rows = _cell(res.get(ref_n), dist), []
    for n in counts:
        c = _cell(res.get(n), dist)
        if not c or "steps" not in c:
            continue
        rows.append([str(n), f"{c['prompt_per_request']:.1f}", f"{c['steps']:.0f}", f"{c['tokens_per_step']:.1f}",
                     f"{_med(c['all_work_tok_s']):.1f}",
                     f"{_med(c['all_work_tok_s']) / _med(one['all_work_tok_s']):.2f}" if one else "-",
                     f"{_med(c['all_tok_s']) / _med(one['all_tok_s']):.2f}" if one else "-"])
    print_table(f"{dist}: loramux's work (median run; prompt tokens evaluated exclude reused prefixes)",
                ["adapters", "prompt tokens / request", "decode steps", "tokens / step", "all tokens/s",
                 f"all tokens/s vs {ref_n}", f"generated tok/s vs {ref_n}"], rows)


def report_baseline(results: dict[str, dict[int, Any]], counts: list[int], args: argparse.Namespace) -> None:
    """--baseline-src / --server-args: the same figures for both servers, run side by side, ratios against each
    one's reference."""
    ref_n = args.reference if args.reference in counts else counts[0]
    for dist in args.dists:
        rows = []
        for label in (BASELINE, "loramux"):
            ref = _cell(results[label].get(ref_n), dist)
            for n in counts:
                c = _cell(results[label].get(n), dist)
                if not c or not ref:
                    continue
                rows.append([label, str(n), f"{_med(c['all_tok_s']):.1f}",
                             f"{_med(c['all_tok_s']) / _med(ref['all_tok_s']):.2f}",
                             f"{_med(c['all_ttft_p50']):.2f} / {_med(c['all_ttft_p99']):.2f}",
                             f"{_med(c['all_ttft_p50']) / _med(ref['all_ttft_p50']):.2f} / "
                             f"{_med(c['all_ttft_p99']) / _med(ref['all_ttft_p99']):.2f}",
                             f"{c.get('slot_wait_max_steps', float('nan')):.0f}",
                             f"{c.get('bank_share', float('nan')):.2f}"])
        this = f"this tree with {args.server_args}" if args.server_args else "this tree"
        other = f"--baseline-src {args.baseline_src}" if args.baseline_src else "its defaults"
        if args.baseline_args:
            other += f" with {args.baseline_args}"
        print_table(f"{dist}: {this} ('loramux') against {other}, side by side (medians of {max(1, args.repeats)} "
                    f"repeats; ratios against {ref_n} adapters)",
                    ["server", "adapters", "tok/s", f"vs {ref_n}", "TTFT p50 / p99 (s)", f"TTFT vs {ref_n}",
                     "slot wait max steps", "bank decodes"], rows)


def plot(results: dict[str, dict[int, Any]], counts: list[int], args: argparse.Namespace, path: Path) -> None:
    """Aggregate tokens/s and TTFT p50 against the number of adapters, per system and distribution."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for system, style in (("loramux", "-o"), ("llama-server", "--s")):
        for dist in args.dists:
            cells = [(n, c) for n in counts if (c := _cell(results[system].get(n), dist))]
            if cells:
                ax.plot([n for n, _ in cells], [c["tok_s"] for _, c in cells], style, label=f"{system}, {dist}")
                ax2.plot([n for n, _ in cells], [c["ttft_p50"] for _, c in cells], style, label=f"{system}, {dist}")
    for a, label in ((ax, "aggregate generated tokens/s"), (ax2, "time to first token, p50 (s)")):
        a.set_xscale("log")
        a.set_xticks(counts, [f"{c:,}" for c in counts])
        a.set_xlabel("distinct adapters" + (f" (≥ {args.cold_from:,}: registered cold)" if counts[-1] >= args.cold_from
                                            else ""))
        a.set_ylabel(label)
        a.set_ylim(bottom=0)
        a.grid(alpha=0.3)
        if max(counts) >= args.cold_from:
            a.axvspan(args.cold_from * 0.8, max(counts) * 1.25, color="0.9", zorder=0)
    ax.legend()
    fig.suptitle(f"{args.parallel} streams, rank-{args.rank} adapters, {args.threads} thread{'s' if args.threads > 1 else ''}")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"\nplot written to {path}")


if __name__ == "__main__":
    main()
