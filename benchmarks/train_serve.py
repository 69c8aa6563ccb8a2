"""Train and serve on one server: factor pushes over HTTP, and a fine-tuning job beside live streams.

    python benchmarks/train_serve.py [--repeats 15] [--ranks 2,16,64] [--streams 8] [--seconds 20] [--rounds 3]

One real server (uvicorn on 127.0.0.1, the default Gemma 3 270M Q4_K_M), measured side by side:

Part 1, push-to-servable latency of an adapter over every projection of the model, by rank:
- servable: from the push's body received by the server to the new version servable (parse of
  the safetensors body, checks, the in-place write at a step boundary), as the server reports it;
  "first push" is the first one into a freshly loaded adapter (it also makes the staging copy);
- transfer: the body's upload as the server saw it (its receive time), and the client's round trip;
- reload (peer): write the factors to an adapter GGUF and POST /v1/load_lora_adapter replace=true.

Part 2, sustained pushes while `--streams` streams decode on another adapter: pushes/s to a rank-16
adapter over every projection, back to back, and the streams' inter-token latency p50/p99 against the
same streams with no pushes.

Part 3, a fine-tuning job (train zo, rank 8, default targets) beside the same streams: the streams'
inter-token p50/p99 against no job, and the job's steps per minute against the job alone, in `--rounds`
side-by-side rounds (the median p99 ratio reported), with the job's engine share (its forwards' time
over its wall time).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402 - benchmarks/ is not a package

from loramux.client import Client  # noqa: E402
from loramux.gguf_io import write_adapter  # noqa: E402

KEY = "bench-admin"
DATA = "".join(json.dumps({"prompt": f"Q: what is {i} plus {i}? A:", "completion": f" {2 * i}"}) + "\n"
               for i in range(16)).encode()


def stream_gaps(url: str, model: str, stop: threading.Event, out: list[float], max_tokens: int = 48) -> None:
    """Stream completions until `stop`; append every inter-token gap (seconds) to `out`."""
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=300) as h:
        while not stop.is_set():
            last = None
            with h.stream("POST", url + "/v1/completions", json=body) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        now = time.perf_counter()
                        if last is not None:
                            out.append(now - last)
                        last = now


def with_streams(url: str, n: int, seconds: float, work: Any = None) -> tuple[list[float], Any]:
    """Run n streams for `seconds` (while `work()` runs in this thread, if given); gaps and work's result."""
    stop, gaps = threading.Event(), []
    threads = [threading.Thread(target=stream_gaps, args=(url, "s", stop, gaps)) for _ in range(n)]
    for t in threads:
        t.start()
    time.sleep(2.0)  # all streams admitted and decoding
    gaps.clear()
    t0 = time.perf_counter()
    result = work(t0 + seconds) if work is not None else time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join(300)
    return gaps, result


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs) * 1e3, q)) if xs else float("nan")


def part1(srv: Any, work: Path, shapes: dict[str, tuple[int, int]], arch: str, ranks: list[int],
          repeats: int) -> list[list[str]]:
    rows = []
    c = Client(srv.url, api_key=KEY)
    h = {"Authorization": f"Bearer {KEY}"}
    for r in ranks:
        name = f"r{r}"
        path = C.write_random_adapter(work / f"{name}.gguf", arch, shapes, r, seed=r)
        assert httpx.post(srv.url + "/v1/load_lora_adapter", headers=h, timeout=300,
                          json={"lora_name": name, "lora_path": str(path)}).status_code == 200
        servable, recv, trip, reload = [], [], [], []
        first = c.push(name, C.random_factors(shapes, r, seed=999))["servable_ms"]  # makes the staging copy
        size = 0
        for i in range(repeats):
            f = C.random_factors(shapes, r, seed=1000 + i)
            t0 = time.perf_counter()
            out = c.push(name, f)
            trip.append((time.perf_counter() - t0) * 1e3)
            servable.append(out["servable_ms"])
            recv.append(out["receive_ms"])
            size = out["bytes"]
        for i in range(repeats):
            f = C.random_factors(shapes, r, seed=2000 + i)
            t0 = time.perf_counter()
            write_adapter(work / f"{name}-reload.gguf", arch, f, float(r), dtype="f32")
            resp = httpx.post(srv.url + "/v1/load_lora_adapter", headers=h, timeout=300,
                              json={"lora_name": name, "lora_path": str(work / f"{name}-reload.gguf"),
                                    "replace": True})
            assert resp.status_code == 200, resp.text
            reload.append((time.perf_counter() - t0) * 1e3)
        rows.append([str(r), f"{size / 2**20:.1f}", C.fmt(C.median(servable), 2), C.fmt(first, 1),
                     C.fmt(C.median(recv), 2),
                     C.fmt(C.median(trip), 1), C.fmt(C.median(reload), 1),
                     f"{C.ratio(C.median(reload), C.median(servable)):.0f}×"])
    return rows


def part2(srv: Any, shapes: dict[str, tuple[int, int]], streams: int, seconds: float) -> list[list[str]]:
    c = Client(srv.url, api_key=KEY)
    factors = [C.random_factors(shapes, 16, seed=i) for i in range(4)]

    def pushes(deadline: float) -> float:
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() < deadline:
            c.push("r16", factors[n % 4])
            n += 1
        return n / (time.perf_counter() - t0)
    quiet, _ = with_streams(srv.url, streams, seconds)
    busy, rate = with_streams(srv.url, streams, seconds, pushes)
    return [["no pushes", "–", C.fmt(pct(quiet, 50), 1), C.fmt(pct(quiet, 99), 1), "1.00×"],
            ["pushes back to back", f"{rate:.1f}", C.fmt(pct(busy, 50), 1), C.fmt(pct(busy, 99), 1),
             f"{C.ratio(pct(busy, 99), pct(quiet, 99)):.2f}×"]]


def run_job(c: Client, base: str, fid: str, steps: int, share: float, chunk: int,
            deadline: float | None = None) -> tuple[float, float]:
    """Run a job until it ends or `deadline` (then cancel it); its steps per minute and engine share."""
    job = c.create_job(fid, model=base, suffix=f"job{time.monotonic_ns() % 10**8}",
                       hyperparameters={"steps": steps, "rank": 8, "share": share, "chunk": chunk})
    t0 = time.perf_counter()
    while c.job(job["id"])["status"] not in ("succeeded", "failed", "cancelled"):
        if deadline is not None and time.perf_counter() > deadline:
            c.cancel(job["id"])
            break
        time.sleep(0.1)
    done = sum(1 for e in c.events(job["id"]) if "train_loss" in e["data"])
    body = c.job(job["id"])
    print(f"job {job['id']}: {done} steps, {body['status']}, engine share {body.get('engine_share')}", file=sys.stderr)
    return done / (time.perf_counter() - t0) * 60, float(body.get("engine_share") or 0.0)


def part3(srv: Any, base: str, streams: int, seconds: float, share: float, chunk: int,
          rounds: int) -> list[list[str]]:
    """`rounds` times, side by side: the streams alone, the job alone, the streams beside the job."""
    c = Client(srv.url, api_key=KEY)
    fid = c.upload_file(DATA)["id"]
    rows, ratios, alone_rates, beside_rates = [], [], [], []
    for k in range(rounds):
        load = os.getloadavg()[0]
        quiet, _ = with_streams(srv.url, streams, seconds)
        alone, _ = run_job(c, base, fid, 10_000, share, chunk, time.perf_counter() + seconds)
        busy, (beside, used) = with_streams(srv.url, streams, seconds,
                                            lambda dl: run_job(c, base, fid, 10_000, share, chunk, dl))
        r = C.ratio(pct(busy, 99), pct(quiet, 99))
        ratios.append(r)
        alone_rates.append(alone)
        beside_rates.append(beside)
        rows += [[f"round {k + 1} (load {load:.1f}): streams alone", C.fmt(pct(quiet, 50), 1),
                  C.fmt(pct(quiet, 99), 1), "1.00×", "–", f"{alone:.1f}", "–"],
                 [f"round {k + 1}: streams + job", C.fmt(pct(busy, 50), 1), C.fmt(pct(busy, 99), 1), f"{r:.2f}×",
                  f"{beside:.1f}", "", f"{used:.2f}"]]
    rows.append([f"median of {rounds} (share {share}, chunk {chunk})", "", "", f"{C.median(ratios):.2f}×",
                 f"{C.median(beside_rates):.1f}", f"{C.median(alone_rates):.1f}", ""])
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    C.common_args(p, repeats=15)
    p.add_argument("--ranks", default="2,16,64")
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--share", type=float, default=0.25, help="the training job's share of the engine thread")
    p.add_argument("--chunk", type=int, default=3, help="the job's cost units per engine command")
    p.add_argument("--rounds", type=int, default=3, help="part 3's side-by-side rounds (medians reported)")
    p.add_argument("--parts", default="1,2,3")
    args = p.parse_args()
    model = C.model_path(args.model)
    info = C.machine_info(args.threads)
    C.print_machine(info)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="loramux-trainserve-"))
    shapes = C.projection_shapes(model)
    from loramux.gguf_io import read_header

    arch = read_header(model).architecture or ""
    C.write_random_adapter(work / "s.gguf", arch, shapes, 8, seed=7)
    base = model.name[:-5] if model.name.endswith(".gguf") else model.name
    with socket.socket() as sock:  # a free port
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    # the server in its own process: the load generator's threads do not share its interpreter
    proc = subprocess.Popen([sys.executable, "-m", "loramux", "serve", str(model), "--port", str(port),
                             "--parallel", str(args.streams), "--n-ctx", "256", "--threads", str(args.threads),
                             "--admin-api-key", KEY, "--adapter-dir", str(work), "--jobs-dir", str(work / "jobs"),
                             "--lora", f"s={work / 's.gguf'}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    srv = SimpleNamespace(url=f"http://127.0.0.1:{port}")
    try:
        C.wait_ready(srv.url, proc)
        run_parts(args, srv, work, shapes, arch, base)
    finally:
        proc.terminate()
        proc.wait(60)


def run_parts(args: argparse.Namespace, srv: Any, work: Path, shapes: dict[str, tuple[int, int]], arch: str,
              base: str) -> None:
    parts = {int(x) for x in args.parts.split(",")}
    if 1 in parts or 2 in parts:
        rows = part1(srv, work, shapes, arch, [int(r) for r in args.ranks.split(",")] if 1 in parts else [16],
                     args.repeats if 1 in parts else 1)
        if 1 in parts:
            C.print_table(f"Push to servable, every projection ({len(shapes)} tensors), medians of {args.repeats} "
                          "(ms)", ["rank", "body MiB", "servable", "first push", "receive", "client round trip",
                                   "reload (GGUF + load)", "reload / servable"], rows)
    if 2 in parts:
        C.print_table(f"Pushes to a rank-16 adapter while {args.streams} streams decode on another "
                      f"({args.seconds:.0f} s each)", ["", "pushes/s", "gap p50 ms", "gap p99 ms", "p99 vs none"],
                      part2(srv, shapes, args.streams, args.seconds))
    if 3 in parts:
        C.print_table(f"A fine-tuning job beside {args.streams} streams ({args.seconds:.0f} s each)",
                      ["", "gap p50 ms", "gap p99 ms", "p99 vs alone", "job steps/min beside", "job alone",
                       "engine share"],
                      part3(srv, base, args.streams, args.seconds, args.share, args.chunk, args.rounds))


if __name__ == "__main__":
    main()
