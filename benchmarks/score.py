"""Scoring throughput: multiple-choice items on four adapters, items/s, loramux vs llama-cpp-python's server.

Each item is a context with four choices, scored under each of four rank-8 adapters over every projection
(16 sequences per item), the way lm-evaluation-harness scores one: echo + logprobs with max_tokens 1, the
continuation's log-likelihood summed from `token_logprobs`. Systems, side by side in one run, same model,
threads and context:

  loramux bank      `loramux serve` with its slot bank: requests on all four adapters share each decode
  loramux rotation  `loramux serve --slots 0`: adapter-set groups take turns (what llama-server does)
  llama-cpp-python  `python -m llama_cpp.server`, one process per adapter (`--lora_path`; its server holds one
                    adapter per model), all four running at once: its best case on one machine

Every system sees the same requests with the same concurrency, all servers are up at once and the repeats go
round-robin over the systems (a shared machine's load changes hit every system alike); medians are reported.
The answers (argmax over the choices) and the logprobs are compared between the systems, so a fast wrong one
would show.

    python benchmarks/score.py                 # default Gemma 3 270M, 24 items
"""

from __future__ import annotations

import argparse
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
    print_machine,
    print_table,
    projection_shapes,
    wait_ready,
    write_random_adapter,
)
from serve import free_port

N_ADAPTERS = 4
SUBJECTS = ["The river", "My neighbour", "The old train", "A small robot", "The library", "Our teacher",
            "The mountain village", "The orchestra"]
VERBS = ["slowly opened", "carefully painted", "quietly watched", "suddenly found", "happily carried",
         "never forgot"]
CHOICES = [" the red door at the end of the hall.", " a letter from a friend far away.",
           " the last apple in the basket.", " an umbrella on a sunny day."]


def items(n: int) -> list[tuple[str, list[str]]]:
    """n contexts of 10-20 tokens, each with the same four choices (answers differ by context and adapter)."""
    return [(f"{SUBJECTS[i % len(SUBJECTS)]} {VERBS[(i // len(SUBJECTS)) % len(VERBS)]} in the morning, and then",
             CHOICES) for i in range(n)]


class Proc:
    def __init__(self, argv: list[str], port: int) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            self.startup = wait_ready(self.url, self.proc, timeout=600, path="/v1/models")
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def loramux_server(model: Path, adapters: list[Path], args: argparse.Namespace, slots: int) -> Proc:
    port = free_port()
    argv = [sys.executable, "-m", "loramux", "serve", str(model), "--port", str(port), "--no-example-adapter",
            "--threads", str(args.threads), "--parallel", str(args.parallel), "--n-ctx", str(args.n_ctx),
            "--slots", str(slots), "--slot-rank", "8"]
    for k, a in enumerate(adapters):
        argv += ["--lora", f"a{k}={a}"]
    return Proc(argv, port)


def llama_cpp_servers(model: Path, adapters: list[Path], args: argparse.Namespace) -> list[Proc]:
    out: list[Proc] = []
    try:
        for a in adapters:
            port = free_port()
            out.append(Proc([sys.executable, "-m", "llama_cpp.server", "--model", str(model), "--lora_path", str(a),
                             "--n_threads", str(args.threads), "--n_threads_batch", str(args.threads),
                             "--n_ctx", str(args.n_ctx), "--logits_all", "true", "--port", str(port),
                             "--host", "127.0.0.1"], port))
    except BaseException:  # one did not start: stop the others
        for p in out:
            p.close()
        raise
    return out


def score_loramux(url: str, work: list[tuple[int, int, str, list[str]]], client: httpx.Client) -> list[float]:
    """One request per (item, adapter) with the item's four prompts; the continuation's summed logprob each."""
    def one(job: tuple[int, int, str, list[str]]) -> list[float]:
        _, adapter, ctx, choices = job
        body = {"model": f"a{adapter}", "prompt": [ctx + c for c in choices], "max_tokens": 1, "logprobs": 0,
                "echo": True, "temperature": 0}
        r = client.post(url + "/v1/completions", json=body, timeout=600)
        r.raise_for_status()
        return [_continuation(ch["logprobs"], len(ctx)) for ch in r.json()["choices"]]
    return [x for lps in CONC.map(one, work) for x in lps]


def score_llama_cpp(urls: list[str], work: list[tuple[int, int, str, list[str]]], client: httpx.Client
                    ) -> list[float]:
    """llama-cpp-python's server takes one prompt per request: one request per (item, adapter, choice)."""
    def one(job: tuple[int, int, str, str]) -> float:
        _, adapter, ctx, choice = job
        body = {"prompt": ctx + choice, "max_tokens": 1, "logprobs": 1, "echo": True, "temperature": 0}
        r = client.post(urls[adapter] + "/v1/completions", json=body, timeout=600)
        r.raise_for_status()
        return _continuation(r.json()["choices"][0]["logprobs"], len(ctx))
    flat = [(i, a, ctx, c) for i, a, ctx, cs in work for c in cs]
    return list(CONC.map(one, flat))


def _continuation(lp: dict[str, Any], ctx_chars: int) -> float:
    """Sum of the logprobs of the tokens from the end of the context on, without the generated token (as
    lm-eval's gguf model does it, by text_offset)."""
    offs, lps = lp["text_offset"][:-1], lp["token_logprobs"][:-1]
    start = next(k for k, o in enumerate(offs) if o >= ctx_chars)
    return float(sum(x for x in lps[start:] if x is not None))


CONC: ThreadPoolExecutor


def answers(lps: list[float]) -> list[int]:
    return [max(range(4), key=lambda k: lps[4 * j + k]) for j in range(len(lps) // 4)]


def main() -> None:
    global CONC
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common_args(ap, repeats=3)
    ap.add_argument("--items", type=int, default=24, help="multiple-choice items (default 24)")
    ap.add_argument("--parallel", type=int, default=8, help="loramux sequences per decode (default 8)")
    ap.add_argument("--concurrency", type=int, default=8, help="requests in flight (default 8)")
    ap.add_argument("--n-ctx", type=int, default=512, help="context per sequence (default 512)")
    ap.add_argument("--no-llama-cpp", action="store_true", help="skip llama-cpp-python's server")
    args = ap.parse_args()
    model = model_path(args.model)
    work_dir = Path(args.work_dir or tempfile.mkdtemp(prefix="loramux-score-bench-"))
    work_dir.mkdir(parents=True, exist_ok=True)
    from loramux.gguf_io import read_header

    arch = read_header(model).architecture or "gemma3"
    shapes = projection_shapes(model)
    adapters = [write_random_adapter(work_dir / f"a{k}.gguf", arch, shapes, 8, seed=10 + k) for k in range(N_ADAPTERS)]
    work = [(i, a, ctx, cs) for i, (ctx, cs) in enumerate(items(args.items)) for a in range(N_ADAPTERS)]
    CONC = ThreadPoolExecutor(args.concurrency)
    info = machine_info(args.threads)
    print_machine(info)
    results: dict[str, Any] = {}
    systems = [("loramux bank", lambda: loramux_server(model, adapters, args, N_ADAPTERS)),
               ("loramux rotation", lambda: loramux_server(model, adapters, args, 0))]
    if not args.no_llama_cpp:
        systems.append(("llama-cpp-python server", lambda: llama_cpp_servers(model, adapters, args)))
    started: dict[str, list[Proc]] = {}
    try:
        for name, start in systems:  # all up at once (idle servers cost nothing), measured in turns
            procs = start()
            started[name] = procs if isinstance(procs, list) else [procs]
        with httpx.Client(limits=httpx.Limits(max_connections=64)) as client:
            runs = {name: ((lambda w, urls=[p.url for p in procs]: score_loramux(urls[0], w, client))
                           if name.startswith("loramux") else
                           (lambda w, urls=[p.url for p in procs]: score_llama_cpp(urls, w, client)))
                    for name, procs in started.items()}
            for run in runs.values():
                run(work[: 2 * N_ADAPTERS])  # warm-up: graphs reserved, slots written
            times: dict[str, list[float]] = {name: [] for name in runs}
            lps: dict[str, list[float]] = {}
            for rep in range(args.repeats):  # round-robin: a load change on a shared machine hits every system
                for name, run in runs.items():
                    t0 = time.perf_counter()
                    lps[name] = run(work)
                    times[name].append(time.perf_counter() - t0)
                    print(f"repeat {rep + 1}: {name} {args.items / times[name][-1]:.3f} items/s", file=sys.stderr)
            for name in runs:
                results[name] = {"seconds": times[name], "items_s": args.items / median(times[name]),
                                 "answers": answers(lps[name]), "logprobs": lps[name],
                                 "startup_s": max(p.startup for p in started[name])}
    finally:
        for procs in started.values():
            for p in procs:
                p.close()
    ref = results["loramux bank"]
    rows = []
    for name, r in results.items():
        agree = sum(a == b for a, b in zip(r["answers"], ref["answers"])) / len(ref["answers"])
        dl = max(abs(a - b) for a, b in zip(r["logprobs"], ref["logprobs"]))
        rows.append([name, f"{r['items_s']:.2f}", f"{r['items_s'] / results[list(results)[-1]]['items_s']:.2f}×",
                     f"{100 * agree:.0f} %", f"{dl:.3g}", f"{median(r['seconds']):.2f}"])
    print_table(f"{args.items} items × 4 choices × {N_ADAPTERS} adapters (items/s counts an item once, all its "
                f"adapters scored); concurrency {args.concurrency}, {args.threads} threads",
                ["system", "items/s", f"vs {list(results)[-1]}", "same answers as bank", "max |Δ logprob|",
                 "median s"], rows)
    dump_json(args.json, {"machine": info, "args": vars(args), "results": results})


if __name__ == "__main__":
    main()
