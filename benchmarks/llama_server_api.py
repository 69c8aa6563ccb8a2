"""llama-server's native API on loramux beside llama-server itself: the same /completion requests to both.

One loramux server (in this process, on 127.0.0.1) and llama.cpp's llama-server (built from the same
vendored source by benchmarks/build_peers.sh) on the same model, one sequence each, the same threads. Each
repeat sends every case once, interleaved: a greedy /completion of N tokens (end of text ignored), plain,
with n_probs (the top 5 of every token) and with a 16-entry logit_bias; on loramux also the same request
through /v1/completions. Reported: the median request time and the generated tokens per second it gives,
and each row against llama-server's plain /completion.

    python benchmarks/llama_server_api.py [--model M.gguf] [--repeats 7] [--tokens 64]
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import time
from typing import Any

import httpx
from _common import (
    common_args,
    machine_info,
    median,
    model_path,
    peer_binary,
    print_machine,
    print_table,
    wait_ready,
)

PROMPT = "Write a short story about a lighthouse keeper who"
# Both servers idle while the other one runs: OpenMP threads that spin while waiting would take the cores from
# the other (set before llama.cpp loads here; llama-server inherits it).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def cases(n: int) -> dict[str, tuple[str, str, dict[str, Any]]]:
    """name → (server, path, body)."""
    base = {"prompt": PROMPT, "n_predict": n, "temperature": 0, "ignore_eos": True}
    bias = [[t, -2.0] for t in range(1000, 1016)]
    out: dict[str, tuple[str, str, dict[str, Any]]] = {}
    for server in ("llama-server", "loramux"):
        out[f"{server} /completion"] = (server, "/completion", base)
        out[f"{server} /completion n_probs 5"] = (server, "/completion", {**base, "n_probs": 5})
        out[f"{server} /completion logit_bias 16"] = (server, "/completion", {**base, "logit_bias": bias})
    out["loramux /v1/completions"] = ("loramux", "/v1/completions", {"prompt": PROMPT, "max_tokens": n,
                                                                      "temperature": 0, "ignore_eos": True})
    return out


def one(url: str, path: str, body: dict[str, Any]) -> tuple[float, int]:
    t0 = time.perf_counter()
    r = httpx.post(url + path, json=body, timeout=600)
    r.raise_for_status()
    out = r.json()
    n = out["tokens_predicted"] if "tokens_predicted" in out else out["usage"]["completion_tokens"]
    return time.perf_counter() - t0, int(n)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common_args(ap, repeats=7)
    ap.add_argument("--tokens", type=int, default=64, help="tokens per request (default 64)")
    args = ap.parse_args()
    import loramux as lm
    from loramux.server import ServerSettings, create_app, serve_in_thread

    model = model_path(args.model)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    peer = subprocess.Popen([str(peer_binary("llama-server")), "-m", str(model), "--host", "127.0.0.1", "--port",
                             str(port), "-c", "2048", "-np", "1", "-t", str(args.threads), "-tb", str(args.threads),
                             "--no-webui"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    urls = {"llama-server": f"http://127.0.0.1:{port}"}
    try:
        wait_ready(urls["llama-server"], peer)
        eng = lm.Engine.load(model, n_ctx=2048, n_parallel=1, n_threads=args.threads)
        print_machine(machine_info(args.threads))
        results: dict[str, list[tuple[float, int]]] = {}
        with serve_in_thread(create_app(eng, ServerSettings(), own_engine=True)) as srv:
            urls["loramux"] = srv.url
            table = cases(args.tokens)
            for server, path, body in table.values():  # warm-up: the prompt's KV, the first graphs
                one(urls[server], path, body)
            for _ in range(args.repeats):
                for name, (server, path, body) in table.items():
                    results.setdefault(name, []).append(one(urls[server], path, body))
    finally:
        peer.terminate()
        peer.wait(30)
    base = median(n / t for t, n in results["llama-server /completion"])
    rows = []
    for name, runs in results.items():
        rate = median(n / t for t, n in runs)
        rows.append([name, f"{median(t for t, _ in runs) * 1000:.0f}", f"{rate:.1f}", f"{rate / base:.2f}×",
                     str(runs[0][1])])
    print_table(f"Greedy /completion, {args.tokens} tokens, {args.repeats} repeats (medians)",
                ["request", "time (ms)", "tok/s", "vs llama-server /completion", "tokens"], rows)


if __name__ == "__main__":
    main()
