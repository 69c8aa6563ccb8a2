"""What llama.cpp's RPC backend costs per token on loopback: local vs the base on 1 worker vs split over 2.

    $LORAMUX_DET_PYTHON benchmarks/rpc.py [--repeats 7] [--tokens 32] [--prompt-tokens 128] [--threads 2]

Needs a Python whose llama.cpp has RPC (scripts/det-venv.sh makes one; or CMAKE_ARGS="-DGGML_RPC=on").
The script starts two `loramux rpc-worker`s on 127.0.0.1 (free ports, --threads as given) and loads
three engines on the same model in this process: local, every layer on worker 1, layers split over
workers 1 and 2 (llama.cpp splits by the workers' free memory: about half each). Each round times,
for every engine in turn (so drifts in the machine's load hit all three alike):

- decode: ms per generated token of a greedy request (max_tokens --tokens, EOS ignored), minus the
  same request with max_tokens 1 (so the prompt's cost cancels);
- prefill: ms for a --prompt-tokens prompt and one generated token;
- decode with an adapter: the same as decode with a rank-8 adapter on every projection, which over
  RPC lives on the workers too.

Only one engine computes at a time, and the workers share the machine's cores with this process, so
the ratios show the protocol's cost (round trips per token, graph and tensor transfers), not a gain.
Medians over --repeats; the ratio columns divide by local.
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402 - benchmarks/ is not a package

PROMPT = "The history of the city begins with a small settlement on the river, where"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_worker(threads: int) -> tuple[subprocess.Popen[bytes], str]:
    from loramux.engine import rpc
    from loramux.errors import RpcError

    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "loramux", "rpc-worker", "--port", str(port),
                             "--threads", str(threads)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            rpc.probe(endpoint, timeout=2)
            return proc, endpoint
        except RpcError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"error: the RPC worker on {endpoint} did not start") from None
            time.sleep(0.2)


def measure(eng: Any, args: argparse.Namespace, long_prompt: list[int], loras: dict[str, float] | None) -> dict:
    g = {"temperature": 0.0, "ignore_eos": True}
    t_one = C.timed(lambda: eng.generate(PROMPT, loras=loras, max_tokens=1, **g))
    t_n = C.timed(lambda: eng.generate(PROMPT, loras=loras, max_tokens=args.tokens, **g))
    out = {"decode_ms": (t_n - t_one) / (args.tokens - 1) * 1e3}
    if loras is None:
        out["prefill_ms"] = C.timed(lambda: eng.generate(long_prompt, max_tokens=1, **g)) * 1e3
    return out


def report(raw: dict[str, list[dict]], model: Path, args: argparse.Namespace) -> dict:
    """Print the table of medians and ratios to local; return the medians."""
    med = {k: {m: C.median(r[m] for r in rows) for m in rows[0]} for k, rows in raw.items()}
    rows = []
    for name in raw:
        m, loc = med[name], med["local"]
        rows.append([name, C.fmt(m["decode_ms"], 2), C.fmt(C.ratio(m["decode_ms"], loc["decode_ms"]), 2) + "×",
                     C.fmt(m["adapter_decode_ms"], 2),
                     C.fmt(C.ratio(m["adapter_decode_ms"], loc["adapter_decode_ms"]), 2) + "×",
                     C.fmt(m["prefill_ms"], 1), C.fmt(C.ratio(m["prefill_ms"], loc["prefill_ms"]), 2) + "×"])
    C.print_table(f"RPC on loopback, {model.name}, {args.threads} threads each, medians of {args.repeats} rounds",
                  ["base placed", "decode ms/token", "vs local", "rank-8 adapter ms/token", "vs local",
                   f"prefill {args.prompt_tokens} tok ms", "vs local"], rows)
    return med


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    C.common_args(ap, repeats=7)
    ap.add_argument("--tokens", type=int, default=32, help="generated tokens per decode measurement")
    ap.add_argument("--prompt-tokens", type=int, default=128, help="prompt length of the prefill measurement")
    args = ap.parse_args()

    from loramux import Engine
    from loramux import _native as N

    if not N.rpc_supported():
        raise SystemExit('error: this llama.cpp has no RPC backend; run with $LORAMUX_DET_PYTHON '
                         '(scripts/det-venv.sh) or install with CMAKE_ARGS="-DGGML_RPC=on"')
    model = C.model_path(args.model)
    info = C.machine_info(args.threads)
    C.print_machine(info)
    procs: list[subprocess.Popen[bytes]] = []
    engines: dict[str, Any] = {}
    try:
        (p1, w1), (p2, w2) = start_worker(args.threads), start_worker(args.threads)
        procs += [p1, p2]
        opts = {"n_ctx": 512, "n_threads": args.threads}
        engines = {"local": Engine.load(model, **opts), "1 worker": Engine.load(model, rpc=[w1], **opts),
                   "2 workers": Engine.load(model, rpc=[w1, w2], **opts)}
        with tempfile.TemporaryDirectory(dir=args.work_dir) as work:
            shapes = C.projection_shapes(model)
            path = C.write_random_adapter(Path(work) / "r8.gguf", engines["local"].model.architecture, shapes, 8, 1)
            for eng in engines.values():
                eng.load_lora(path, "r8")
        long_prompt = (engines["local"].tokenize(PROMPT * 20))[: args.prompt_tokens]
        raw: dict[str, list[dict]] = {k: [] for k in engines}
        for eng in engines.values():  # warm-up: graphs reserved, caches touched
            measure(eng, args, long_prompt, None)
            measure(eng, args, long_prompt, {"r8": 1.0})
        for _ in C.progress(range(args.repeats), "rounds"):
            for name, eng in engines.items():
                row = measure(eng, args, long_prompt, None)
                row["adapter_decode_ms"] = measure(eng, args, long_prompt, {"r8": 1.0})["decode_ms"]
                raw[name].append(row)
    finally:
        for eng in engines.values():
            eng.close()
        for p in procs:
            p.kill()
            p.wait(30)
    med = report(raw, model, args)
    C.dump_json(args.json, {"machine": info, "args": vars(args), "raw": raw, "median": med})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
