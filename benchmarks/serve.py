"""Serving throughput and latency: loramux serve vs llama-server, one adapter vs requests spread over four.

Both servers run as subprocesses on 127.0.0.1 with the same model, threads and parallel slots, and
four rank-8 adapters over every projection. A load generator keeps N requests in flight (greedy,
fixed length, EOS ignored) and measures aggregate generated tokens/s and per-request latency.

Cases: (a) every request on adapter 0; (b) requests spread round-robin over the four adapters.
loramux runs with its default bank sizing (a slot per parallel sequence; none at `--parallel 1`), with
adapter-set groups taking turns (`--slots 0`, what llama-server does), and in deterministic mode. Also: the time to hot-load a new adapter while
serving (llama-server has to restart to add one: its start-up time is shown next to it).

    python benchmarks/serve.py                # needs benchmarks/build_peers.sh for llama-server
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
from _common import (
    common_args,
    dump_json,
    machine_info,
    median,
    model_path,
    peer_binary,
    print_machine,
    print_table,
    projection_shapes,
    wait_ready,
    write_random_adapter,
)

N_ADAPTERS = 4
RUN_STRIDE = 1024  # unique prompts: run r's request i starts with opener r * RUN_STRIDE + i
PROMPTS = ["Write a short story about a lighthouse keeper who", "Explain how rivers shape valleys over",
           "List three reasons why people enjoy cooking and", "Describe the sound of rain on a tin roof and"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, argv: list[str], kind: str, adapters: list[str], start_timeout: float = 300) -> None:
        self.port = free_port()
        self.kind, self.adapters = kind, adapters
        self.unique_prompts = False  # True: request i's prompt starts with its own token (no prefix reuse)
        self.unique_seed = 0  # set per run, so a repeat does not reuse the previous run's prompts
        self.openers: tuple[str, ...] = ()  # one-token words for unique prompts (`prompt_openers`)
        self.url = f"http://127.0.0.1:{self.port}"
        argv = argv + ["--port", str(self.port)]
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.startup = wait_ready(self.url, self.proc, timeout=start_timeout)

    def body(self, i: int, adapter: int | None, n: int) -> dict[str, Any]:
        prompt = PROMPTS[i % len(PROMPTS)]
        if self.unique_prompts:  # every request's KV differs from its first token: nothing to reuse
            k = self.unique_seed * RUN_STRIDE + i
            if i >= RUN_STRIDE or k >= len(self.openers):
                raise ValueError(f"unique prompts: request {i} of run {self.unique_seed} needs opener {k}, "
                                 f"but {len(self.openers)} were set (Server.openers = prompt_openers(model)), "
                                 f"{RUN_STRIDE} per run")
            prompt = f"{self.openers[k]} {i}, {self.unique_seed}: {prompt}"
        b: dict[str, Any] = {"prompt": prompt, "max_tokens": n, "temperature": 0.0,
                             "ignore_eos": True}
        if self.kind == "llama-server":
            b["model"] = "base"
            b["lora"] = [{"id": k, "scale": 1.0 if k == adapter else 0.0} for k in range(len(self.adapters))]
        else:
            b["model"] = f"a{adapter}"
        return b

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def run_load(srv: Server, spread: bool, n_requests: int, concurrency: int, n_tokens: int) -> dict[str, float]:
    def one(i: int) -> tuple[float, int]:
        adapter = i % N_ADAPTERS if spread else 0
        t0 = time.perf_counter()
        r = httpx.post(srv.url + "/v1/completions", json=srv.body(i, adapter, n_tokens), timeout=600)
        r.raise_for_status()
        return time.perf_counter() - t0, int(r.json()["usage"]["completion_tokens"])
    with ThreadPoolExecutor(concurrency) as ex:
        list(ex.map(one, range(concurrency)))  # warm-up: graphs reserved, slots written
        t0 = time.perf_counter()
        res = list(ex.map(one, range(n_requests)))
        wall = time.perf_counter() - t0
    lat = sorted(x for x, _ in res)
    return {"tok_s": sum(n for _, n in res) / wall, "p50": median(lat),
            "p99": lat[min(len(lat) - 1, int(0.99 * len(lat)))], "wall": wall}


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median throughput (its latencies with it), plus every throughput seen."""
    ordered = sorted(runs, key=lambda r: r["tok_s"])
    return {**ordered[(len(ordered) - 1) // 2], "all_tok_s": [r["tok_s"] for r in runs]}


ADMIN_KEY = "bench-admin"  # the servers run on 127.0.0.1 for the length of the benchmark


def hot_load(srv: Server, path: str) -> float:
    t0 = time.perf_counter()
    r = httpx.post(srv.url + "/v1/load_lora_adapter", json={"lora_name": "hot", "lora_path": path}, timeout=120,
                   headers={"Authorization": f"Bearer {ADMIN_KEY}"})  # loading is on the admin plane
    r.raise_for_status()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common_args(ap, repeats=1)  # --repeats N: N load runs per case, the median run is reported
    ap.add_argument("--parallel", type=int, default=8, help="server slots and requests in flight (default 8)")
    ap.add_argument("--requests", type=int, default=32, help="requests per case (default 32)")
    ap.add_argument("--tokens", type=int, default=64, help="generated tokens per request (default 64)")
    ap.add_argument("--no-llama-server", action="store_true", help="skip the llama-server peer")
    ap.add_argument("--no-deterministic", action="store_true", help="skip the deterministic-mode row")
    args = ap.parse_args()
    model = model_path(args.model)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="loramux-serve-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    shapes = projection_shapes(model)
    from loramux.gguf_io import read_header

    arch = read_header(model).architecture or "?"
    adapters = [str(write_random_adapter(work / f"a{k}.gguf", arch, shapes, 8, 100 + k)) for k in range(N_ADAPTERS)]
    hot = str(write_random_adapter(work / "hot.gguf", arch, shapes, 8, 999))
    info = machine_info(args.threads)
    print_machine(info)
    common = ["--n-ctx", "512", "--threads", str(args.threads), "--parallel", str(args.parallel)]
    lm_argv = [sys.executable, "-m", "loramux", "serve", str(model), *common, "--adapter-dir", str(work),
               "--admin-api-key", ADMIN_KEY,
               *[x for k, a in enumerate(adapters) for x in ("--lora", f"a{k}={a}")]]
    systems: list[tuple[str, list[str], str]] = []
    if not args.no_llama_server:
        ls = str(peer_binary("llama-server"))
        systems.append(("llama-server", [ls, "-m", str(model), "-t", str(args.threads), "-np", str(args.parallel),
                                          "-c", str(512 * args.parallel), "--no-webui",
                                          "--lora", ",".join(adapters)], "llama-server"))
    systems.append(("loramux (default: --slots = --parallel)", lm_argv, "loramux"))
    systems.append(("loramux (groups take turns)", lm_argv + ["--slots", "0"], "loramux"))
    if not args.no_deterministic:
        systems.append(("loramux --deterministic (bank)", lm_argv + ["--slots", str(N_ADAPTERS), "--deterministic"],
                        "loramux"))
    results: dict[str, Any] = {}
    for label, argv, kind in systems:
        srv = Server(argv, kind, adapters)
        try:
            ones, spreads = [], []
            for _ in range(max(1, args.repeats)):  # one adapter and spread alternate, each once per repeat
                ones.append(run_load(srv, False, args.requests, args.parallel, args.tokens))
                spreads.append(run_load(srv, True, args.requests, args.parallel, args.tokens))
            one, spread = median_run(ones), median_run(spreads)
            hl = hot_load(srv, hot) if kind == "loramux" else None
        finally:
            srv.close()
        results[label] = {"one": one, "spread": spread, "startup_s": srv.startup, "hot_load_s": hl}
        print(f"{label}: one {one['tok_s']:.1f} tok/s, spread {spread['tok_s']:.1f} tok/s", file=sys.stderr)
    report(results, args)
    dump_json(args.json, {"machine": info, "results": results, "args": vars(args)})


def report(results: dict[str, Any], args: argparse.Namespace) -> None:
    ref = results.get("llama-server")
    rows = []
    for label, r in results.items():
        rows.append([label, f"{r['one']['tok_s']:.1f}", f"{r['spread']['tok_s']:.1f}",
                     f"{r['spread']['tok_s'] / r['one']['tok_s']:.2f}",
                     f"{r['one']['tok_s'] / ref['one']['tok_s']:.2f}×" if ref else "-",
                     f"{r['spread']['tok_s'] / ref['spread']['tok_s']:.2f}×" if ref else "-",
                     f"{r['one']['p50']:.2f} / {r['one']['p99']:.2f}", f"{r['spread']['p50']:.2f} / {r['spread']['p99']:.2f}",
                     f"{r['hot_load_s'] * 1000:.0f} ms" if r["hot_load_s"] else f"restart {r['startup_s']:.1f} s"])
    print_table(f"{args.parallel} concurrent streams, {args.requests} requests × {args.tokens} tokens, "
                f"{args.threads} threads, four rank-8 adapters (aggregate generated tokens/s; latency s)",
                ["system", "(a) one adapter", "(b) 4 adapters", "b/a", "(a) vs llama-server",
                 "(b) vs llama-server", "(a) p50/p99", "(b) p50/p99", "add an adapter"], rows)
    print(json.dumps({k: {"one": round(v["one"]["tok_s"], 1), "spread": round(v["spread"]["tok_s"], 1)}
                      for k, v in results.items()}))


if __name__ == "__main__":
    main()
