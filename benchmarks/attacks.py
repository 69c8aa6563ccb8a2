"""Costly requests beside a normal one: how much each attack slows an 8-token neighbour on `loramux serve`.

One `loramux serve` subprocess (default settings, loopback). The neighbour is an 8-token greedy completion
(EOS ignored); its latency is measured alone, and sent 50 ms after one attack request, in turn,
`--repeats` times each. The table shows the neighbour's median latency without and with each attack,
their ratio (the budgets aim at ≤ 2×), the ratio of the server's CPU seconds while the neighbour ran
(the work the attack added to the neighbour's time; steadier than latency on a machine others load), how long the attack request itself took (the price of its budgets:
a scoring request served in smaller pieces takes longer), and what the attack requests got back (HTTP status and error
code, counted). The "control" row is a trivially invalid request: the cost of any refusal. (A client
that sends requests back to back without pause slows everyone through the HTTP layer alone, cheap 400s
included: rate limits belong in front of the server.)

    python benchmarks/attacks.py                      # the embedded Gemma 3 270M
    python benchmarks/attacks.py --only nested10,scoring --repeats 9
    python benchmarks/attacks.py --against ../old-checkout    # this tree and another, attack by attack
    python benchmarks/attacks.py --only fanout --variant "all4=--request-slots 4 --request-step-seqs 4"
    python benchmarks/functiongemma_shape.py -o FG.gguf    # Gemma 3 270M with FunctionGemma's tokens and template
    python benchmarks/attacks.py --only control,tools,tools_deep --model FG.gguf --variant "fg=--tool-format function_gemma"

`--variant LABEL=OPTIONS` serves this tree once more with those `loramux serve` options (repeatable): the
settings compared in the same run, in turn. Every measurement records the 1-minute load average, and the
table gives its median per row (the machine's load is part of every figure).

The `tools` and `tools_deep` rows force a tool call (`tool_choice: "required"`): `tools_deep` with the review's
FunctionGemma finding, a parameter schema of lists of lists 30 deep. On the embedded model they run in the
generic JSON format; FunctionGemma's format needs its control tokens in the vocabulary: a FunctionGemma
`--model`, or for cost measurements functiongemma_shape.py's stand-in (FG.gguf above), whose template selects
that format by itself (the `fg` variant names it; `--variant "json=--tool-format generic"` adds the generic
format on the same model).
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
from _common import (
    REPO_ROOT,
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

sys.path.insert(0, str(REPO_ROOT / "tests"))  # the adversarial suite's hostile tool schema (needs hypothesis)
from grammar_fuzz import deep_arrays  # noqa: E402


def _nested(n: int) -> str:
    return f"((a?){{{n}}}){{{n}}}"


def _colliding(n: int) -> dict[str, Any]:
    props = {"a" + chr(0x4E00 + i): {} for i in range(n)}
    return {"type": "object", "properties": props, "required": list(props)}


def _tool(k: int) -> dict[str, Any]:
    props = {f"field_{k}_{i}": {"type": "string", "enum": [f"v{j}" for j in range(6)]} for i in range(4)}
    return {"type": "function", "function": {"name": f"book_{k}", "description": f"Booking form {k}.", "parameters": {
        "type": "object", "properties": props, "required": list(props)}}}


def _deep_tool(depth: int) -> dict[str, Any]:
    return {"type": "function", "function": {"name": "book_deep", "description": "Nested booking lists.",
                                             "parameters": deep_arrays(depth)}}


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
        # not an attack: one ordinary request beside the neighbour, the cost of sharing the engine at all (on a
        # model whose decode step is mostly its output projection, a second sequence nearly doubles a step)
        "plain": ("/v1/completions", {"prompt": "Tell me a story.", "max_tokens": 64, "ignore_eos": True}),
        "fanout": ("/v1/completions", {"prompt": "Tell me a story.", "max_tokens": 64, "n": 16,
                                       "ignore_eos": True}),
        # a forced call against a tool schema: the template's format (generic JSON on Gemma 3), or under
        # `--tool-format function_gemma` (with a FunctionGemma --model or functiongemma_shape.py's stand-in:
        # the format's grammar names its <escape> token, which other Gemma 3 vocabularies lack, so they get
        # a 400) its own grammar
        "tools": (chat, {"messages": [{"role": "user", "content": "Book it."}], "max_tokens": 64,
                         "tools": [_tool(k) for k in range(3)], "tool_choice": "required"}),
        # the same with the review's FunctionGemma finding: one tool whose parameter is a list of lists 30
        # deep (under 1 KB of schema), once a 1.68 GB call grammar in the FunctionGemma format (each level
        # inlined its items twice); the generic format turns it into JSON-schema rules
        "tools_deep": (chat, {"messages": [{"role": "user", "content": "Book it."}], "max_tokens": 64,
                              "tools": [_deep_tool(30)], "tool_choice": "required"}),
    }


def attack_once(url: str, path: str, body: dict[str, Any], outcomes: Counter[str],
                took: list[float]) -> threading.Thread:
    """Send one attack request on a thread of its own; its outcome (HTTP status, error code) is counted and
    its latency appended to `took`."""
    def run() -> None:
        t0 = time.perf_counter()
        try:
            r = httpx.post(url + path, json=body, timeout=600)
            code = r.json().get("error", {}).get("code") if r.status_code != 200 else "ok"
            outcomes[f"{r.status_code} {code}"] += 1
        except (httpx.HTTPError, ValueError) as e:
            outcomes[type(e).__name__] += 1
        took.append(time.perf_counter() - t0)
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


def start_server(args: argparse.Namespace, src: str | None,
                 extra: list[str] | None = None) -> tuple[subprocess.Popen[bytes], str]:
    """`loramux serve` from this checkout, or (src) from another source tree's `src` directory, with
    `extra` options."""
    port = free_port()
    argv = [sys.executable, "-m", "loramux", "serve", str(model_path(args.model)), "--port", str(port),
            "--threads", str(args.threads), "--parallel", str(args.parallel), "--no-example-adapter",
            *(extra or [])]
    env = dict(os.environ, PYTHONPATH=str(Path(src).resolve() / "src")) if src else None
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    url = f"http://127.0.0.1:{port}"
    wait_ready(url, proc)
    neighbour(url, 2)  # warm up
    return proc, url


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds the process has used so far, all threads (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def timed_neighbour(url: str, pid: int) -> tuple[float, float]:
    """One neighbour request: (its latency, the server's CPU seconds meanwhile)."""
    c0 = cpu_seconds(pid)
    wall = neighbour(url, 1)[0]
    return wall, cpu_seconds(pid) - c0


def measure(url: str, pid: int, path: str, body: dict[str, Any], into: dict[str, Any]) -> None:
    """The neighbour alone, then attacked (the shared machine drifts: alone and attacked go in turn)."""
    into["load"].append(os.getloadavg()[0])
    wall, cpu = timed_neighbour(url, pid)
    into["alone"].append(wall)
    into["alone_cpu"].append(cpu)
    outcomes = Counter[str]()
    t = attack_once(url, path, body, outcomes, into["attack"])
    time.sleep(0.05)  # the attack request first, as a client racing the neighbour would
    wall, cpu = timed_neighbour(url, pid)
    into["attacked"].append(wall)
    into["attacked_cpu"].append(cpu)
    t.join(600)
    for k, v in outcomes.items():
        into["outcomes"][k] = into["outcomes"].get(k, 0) + v


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common_args(ap, repeats=5)
    ap.add_argument("--only", default=None, help="comma-separated attack names (default: all)")
    ap.add_argument("--parallel", type=int, default=4, help="loramux serve --parallel (default 4)")
    ap.add_argument("--against", default=None, metavar="TREE",
                    help="also serve from this source tree (a checkout of another version), measured in turn "
                         "with this one, attack by attack")
    ap.add_argument("--variant", action="append", default=[], metavar="LABEL=OPTIONS",
                    help="also serve this tree with these `loramux serve` options, measured in turn (repeatable)")
    args = ap.parse_args()
    chosen = attacks()
    if args.only:
        chosen = {k: v for k, v in chosen.items() if k in args.only.split(",")}
    info = machine_info(args.threads)
    print_machine(info)
    servers: dict[str, tuple[subprocess.Popen[bytes], str]] = {}
    rows, raw = [], {}
    try:
        servers["this"] = start_server(args, None)
        if args.against:
            servers[Path(args.against).name] = start_server(args, args.against)
        for v in args.variant:
            label, _, options = v.partition("=")
            servers[label] = start_server(args, None, shlex.split(options))
        for name, (path, body) in chosen.items():
            got_by = {label: {"alone": [], "attacked": [], "alone_cpu": [], "attacked_cpu": [], "attack": [],
                              "load": [], "outcomes": {}} for label in servers}
            for _ in range(args.repeats):
                for label, (proc, url) in servers.items():  # the servers in turn, repeat by repeat
                    measure(url, proc.pid, path, body, got_by[label])
            for label, m in got_by.items():
                raw.setdefault(label, {})[name] = m
                alone, during, took = m["alone"], m["attacked"], m["attack"]
                got = ", ".join(f"{k} ×{v}" for k, v in Counter(m["outcomes"]).most_common(3))
                cpu = ratio(median(m["attacked_cpu"]), median(m["alone_cpu"]))
                rows.append([name, label, f"{median(alone):.2f}", f"{median(during):.2f}",
                             f"{ratio(median(during), median(alone)):.2f}×", f"{cpu:.2f}×", f"{median(took):.2f}",
                             f"{median(m['load']):.1f}", got])
                print(f"  {name} ({label}): {median(alone):.2f} s -> {median(during):.2f} s ({got})",
                      file=sys.stderr)
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    print_table(f"neighbour: 8 tokens, greedy, median of {args.repeats}; attacked: sent 50 ms after one attack request",
                ["attack", "server", "alone (s)", "attacked (s)", "ratio", "CPU ratio", "attack took (s)",
                 "load", "attacker got"], rows)
    print(f"load average at the end: {[round(x, 2) for x in os.getloadavg()]}")
    dump_json(args.json, {"machine": info, "raw": raw})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
