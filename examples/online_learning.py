"""Online learning against a live server: a trainer outside it pushes a new adapter version every step
and samples from it through the OpenAI client, on a quantized base, on a CPU.

The trainer is the zeroth-order (SPSA) loop itself, over HTTP: every step it draws a direction z,
pushes θ+εz and θ−εz into a probe adapter and scores the data under each (prompt log-probabilities
from /v1/completions with echo, each request pinned to the version it pushed: ``model="probe@N"``),
moves θ against the measured slope and pushes θ into the served adapter, whose new version the next
sample names in ``adapter_versions``. Clients of the served adapter only ever see whole updates.

    python examples/online_learning.py --steps 5 --threads 1          # starts its own server
    python examples/online_learning.py --url http://127.0.0.1:8080 --key ADMIN_KEY   # an existing one
                                        # (with adapters "online" and "probe" loaded, same rank and targets)
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import openai

import loramux as lm
from loramux.client import Client
from loramux.gguf_io import read_header, write_adapter
from loramux.server import ServerSettings, create_app, serve_in_thread

TEXTS = ["Q: what colour is the sky? A: blue", "Q: what colour is grass? A: green",
         "Q: what colour is snow? A: white"]


@contextlib.contextmanager
def own_server(model: Path | None, threads: int, rank: int) -> Iterator[tuple[str, str]]:
    """A server on 127.0.0.1 with two zero-initialised adapters, "online" and "probe" (attn_q, attn_v)."""
    path = Path(model) if model else lm.default_model_path()
    header = read_header(path)
    shapes = {n: tuple(int(d) for d in t.shape) for n, t in header.tensors.items()
              if n.endswith((".attn_q.weight", ".attn_v.weight"))}
    rng = np.random.default_rng(0)
    factors = {n: ((rng.standard_normal((rank, i)) * 0.02).astype(np.float32), np.zeros((o, rank), np.float32))
               for n, (o, i) in shapes.items()}
    with tempfile.TemporaryDirectory(prefix="loramux-online-") as tmp:
        eng = lm.Engine.load(path, n_ctx=512, n_parallel=2, n_threads=threads)
        for name in ("online", "probe"):
            eng.load_lora(write_adapter(Path(tmp) / f"{name}.gguf", header.architecture or "", factors,
                                        float(rank)), name)
        app = create_app(eng, ServerSettings(admin_api_key="example-admin"), own_engine=True)
        with serve_in_thread(app) as srv:
            yield srv.url, "example-admin"


def loss(oa: openai.OpenAI, model: str) -> float:
    """Mean negative log-likelihood of TEXTS under `model` (prompt scoring: echo, max_tokens 0)."""
    r = oa.completions.create(model=model, prompt=TEXTS, max_tokens=0, echo=True, logprobs=0)
    lps = [lp for c in r.choices for lp in c.logprobs.token_logprobs if lp is not None]
    return -float(np.mean(lps))


def train(url: str, key: str, steps: int, lr: float, eps: float, seed: int) -> None:
    c = Client(url, api_key=key)
    oa = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=300)
    shapes = c.adapter("online")["factors"]
    rng = np.random.default_rng(seed)
    theta = {n: (np.zeros(s["a"], np.float32) + rng.standard_normal(s["a"]).astype(np.float32) * 0.02,
                 np.zeros(s["b"], np.float32)) for n, s in shapes.items()}
    print(f"start: loss {loss(oa, 'online'):.4f}")
    for step in range(1, steps + 1):
        z = {n: (rng.standard_normal(a.shape, dtype=np.float32), rng.standard_normal(b.shape, dtype=np.float32))
             for n, (a, b) in theta.items()}
        scored = []
        for sign in (1.0, -1.0):
            moved = {n: (a + sign * eps * z[n][0], b + sign * eps * z[n][1]) for n, (a, b) in theta.items()}
            v = c.push("probe", moved)["version"]
            scored.append(loss(oa, f"probe@{v}"))  # the loss of exactly the factors just pushed
        g = (scored[0] - scored[1]) / (2 * eps)
        step_lr = lr * np.sign(g)  # a sign step: robust to the slope's scale
        theta = {n: (a - step_lr * z[n][0], b - step_lr * z[n][1]) for n, (a, b) in theta.items()}
        version = c.push("online", theta)["version"]
        sample = oa.completions.create(model="online", prompt="Q: what colour is the sky? A:", max_tokens=4,
                                       temperature=0)
        print(f"step {step}: loss+ {scored[0]:.4f} loss- {scored[1]:.4f} -> pushed version {version}; "
              f"sample on version {sample.model_extra['adapter_versions']['online']}: {sample.choices[0].text!r}")
    print(f"end: loss {loss(oa, 'online'):.4f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="a running loramux server (default: start one on the default model)")
    ap.add_argument("--key", help="its admin key")
    ap.add_argument("--model", help="base GGUF for the server started here (default: the embedded model)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--eps", type=float, default=1e-2)
    ap.add_argument("--rank", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    if args.url:
        train(args.url.rstrip("/"), args.key or "", args.steps, args.lr, args.eps, args.seed)
        return
    with own_server(args.model, args.threads, args.rank) as (url, key):
        train(url, key, args.steps, args.lr, args.eps, args.seed)


if __name__ == "__main__":
    main()
