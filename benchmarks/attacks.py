"""Costly requests beside a normal one: how much each attack slows an 8-token neighbour on `loramux serve`.

One `loramux serve` subprocess (default settings, loopback). The neighbour is an 8-token greedy completion
(EOS ignored); its latency is measured alone, and sent 50 ms after one attack request, in turn,
`--repeats` times each. The table shows the neighbour's median latency without and with each attack,
their ratio (the budgets aim at ≤ 2×), and what the attack requests got back (HTTP status and error
code, counted). The "control" row is a trivially invalid request: the cost of any refusal. (A client
that sends requests back to back without pause slows everyone through the HTTP layer alone, cheap 400s
included: rate limits belong in front of the server.)

    python benchmarks/attacks.py                      # the embedded Gemma 3 270M
    python benchmarks/attacks.py --only nested10,scoring --repeats 9
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time
from collections import Counter
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
    ratio,
    wait_ready,
)
from serve import free_port


def _nested(n: int) -> str:
    return f"((a?){{{n}}}){{{n}}}"


def _colliding(n: int) -> dict[str, Any]:
    props = {"a" + chr(0x4E00 + i): {} for i in range(n)}
    return {"type": "object", "properties": props, "required": list(props)}


def attacks() -> dict[str, tuple[str, dict[str, Any]]]:
    """name -> (path, body) of each proof of concept (the findings of the grammar and scoring review)."""
    chat = "/v1/chat/completions"
    msg = [{"role": "user", "content": "Answer."}]
    enum = {"type": "json_schema", "json_schema": {"name": "e", "strict": True, "schema": {
        "type": "object", "properties": {"v": {"enum": [f"s{i}" for i in range(24000)]}}, "required": ["v"],
        "additionalProperties": False}}}
    return {
        "control": ("/v1/completions", {"prompt": "a", "max_tokens": -1}),  # the floor: any cheap 400, back to back
        "nested10": ("/v1/completions", {"prompt": "a", "max_tokens": 4, "guided_regex": _nested(10)}),
        "nested20": ("/v1/completions", {"prompt": "a", "max_tokens": 4, "guided_regex": _nested(20)}),
        "pattern10": ("/v1/completions", {"prompt": "a", "max_tokens": 4, "guided_json": {
            "type": "string", "pattern": _nested(10)}}),
        "gbnf32k": ("/v1/completions", {"prompt": "a", "max_tokens": 4, "grammar": "root ::= " + " | ".join(
            f'"w{i}"' for i in range(32768))}),
        "enum24k": (chat, {"messages": msg, "max_tokens": 4, "response_format": enum}),
        "choice500": ("/v1/completions", {"prompt": "a", "max_tokens": 8, "guided_choice": [
            f"option number {i}" for i in range(500)]}),
        "schema_names": ("/v1/completions", {"prompt": "a", "max_tokens": 4, "guided_json": _colliding(6000)}),
        "scoring": ("/v1/completions", {"prompt": "The history of the river valley. " * 160, "max_tokens": 1,
                                        "echo": True, "logprobs": 20, "prompt_logprobs": 20}),
        "fanout": ("/v1/completions", {"prompt": "Tell me a story.", "max_tokens": 64, "n": 16,
                                       "ignore_eos": True}),
    }


def attack_once(url: str, path: str, body: dict[str, Any], outcomes: Counter[str]) -> threading.Thread:
    """Send one attack request on a thread of its own; its outcome (HTTP status, error code) is counted."""
    def run() -> None:
        try:
            r = httpx.post(url + path, json=body, timeout=600)
            code = r.json().get("error", {}).get("code") if r.status_code != 200 else "ok"
            outcomes[f"{r.status_code} {code}"] += 1
        except (httpx.HTTPError, ValueError) as e:
            outcomes[type(e).__name__] += 1
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def neighbour(url: str, repeats: int) -> list[float]:
    out = []
    with httpx.Client(timeout=600) as c:
        for i in range(repeats):
            t0 = time.perf_counter()
            r = c.post(url + "/v1/completions", json={"prompt": f"The capital of France is {i}", "max_tokens": 8,
                                                      "temperature": 0, "ignore_eos": True})
            r.raise_for_status()
            out.append(time.perf_counter() - t0)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common_args(ap, repeats=5)
    ap.add_argument("--only", default=None, help="comma-separated attack names (default: all)")
    ap.add_argument("--parallel", type=int, default=4, help="loramux serve --parallel (default 4)")
    args = ap.parse_args()
    chosen = attacks()
    if args.only:
        chosen = {k: v for k, v in chosen.items() if k in args.only.split(",")}
    info = machine_info(args.threads)
    print_machine(info)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "loramux", "serve", str(model_path(args.model)), "--port", str(port),
            "--threads", str(args.threads), "--parallel", str(args.parallel), "--no-example-adapter"]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rows, raw = [], {}
    try:
        wait_ready(url, proc)
        neighbour(url, 2)  # warm up
        base = neighbour(url, args.repeats)
        raw["alone"] = base
        for name, (path, body) in chosen.items():
            alone, during, outcomes = [], [], Counter[str]()
            for _ in range(args.repeats):  # alone and attacked in turn: the shared machine drifts
                alone += neighbour(url, 1)
                t = attack_once(url, path, body, outcomes)
                time.sleep(0.05)  # the attack request first, as a client racing the neighbour would
                during += neighbour(url, 1)
                t.join(600)
            raw[name] = {"alone": alone, "attacked": during, "outcomes": dict(outcomes)}
            got = ", ".join(f"{k} ×{v}" for k, v in outcomes.most_common(3))
            rows.append([name, f"{median(alone):.2f}", f"{median(during):.2f}",
                         f"{ratio(median(during), median(alone)):.2f}×", got])
            print(f"  {name}: {median(alone):.2f} s -> {median(during):.2f} s ({got})", file=sys.stderr)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    print_table(f"neighbour: 8 tokens, greedy, median of {args.repeats}; attacked: sent 50 ms after one attack request",
                ["attack", "alone (s)", "attacked (s)", "ratio", "attacker got"], rows)
    dump_json(args.json, {"machine": info, "raw": raw})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
