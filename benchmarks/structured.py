"""Constrained decoding speed: JSON-schema output vs free text, loramux vs llama-server, side by side.

Each system runs as a real server on 127.0.0.1 with the same model and threads. Requests go one at a time
(streamed, so that the decode rate is measured from the first token to the last: prompt processing is
left out) for four cases per system: free text, a JSON schema (`response_format` json_schema, strict; for
llama-server its `json_schema` field, the grammar it builds from it), JSON mode, and a regex / GBNF grammar.
The table shows decode tokens/s (median over requests) and the ratios: constrained / free on the same
system, and loramux / llama-server in the same case.

    python benchmarks/structured.py              # needs benchmarks/build_peers.sh for llama-server
    python benchmarks/structured.py --no-llama-server
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import httpx
from _common import (
    common_args,
    dump_json,
    fmt,
    machine_info,
    median,
    model_path,
    peer_binary,
    print_machine,
    print_table,
    ratio,
)
from serve import Server

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
        "rating": {"type": "number", "minimum": 0, "maximum": 10},
        "genres": {"type": "array", "items": {"enum": ["drama", "comedy", "action", "horror", "documentary"]},
                   "maxItems": 3},
        "cast": {"type": "array", "items": {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 24}, "role": {"type": "string", "maxLength": 24}},
            "required": ["name", "role"], "additionalProperties": False}, "maxItems": 4},
        "summary": {"type": "string", "maxLength": 200},
    },
    "required": ["title", "year", "rating", "genres", "cast", "summary"],
    "additionalProperties": False,
}
PROMPTS = ["Describe a film about a lighthouse keeper as JSON.", "Describe a comedy set in a bakery as JSON.",
           "Describe a documentary about rivers as JSON.", "Describe an action film on a train as JSON."]
GBNF = 'root ::= "Answer: " [a-z ]{20,200} "."'


def body(kind: str, case: str, prompt: str, n: int) -> dict[str, Any]:
    b: dict[str, Any] = {"messages": [{"role": "user", "content": prompt}], "max_tokens": n, "temperature": 0.0,
                         "stream": True, "stream_options": {"include_usage": True}}
    if case == "free":
        b["ignore_eos"] = True
    elif case == "json_schema":
        if kind == "llama-server":
            b["json_schema"] = SCHEMA
        else:
            b["response_format"] = {"type": "json_schema", "json_schema": {"name": "film", "schema": SCHEMA,
                                                                            "strict": True}}
    elif case == "json_object":
        b["response_format"] = {"type": "json_object"}
    elif case == "grammar":
        b["grammar"] = GBNF
    return b


def one(srv: Server, case: str, prompt: str, n: int) -> tuple[float, int, bool]:
    """(decode tok/s from first to last token, completion tokens, whether the output is valid)."""
    first = last = None
    text, usage = [], None
    with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body(srv.kind, case, prompt, n),
                      timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            d = json.loads(line[6:])
            if d.get("usage"):
                usage = d["usage"]
            for c in d.get("choices") or ():
                piece = (c.get("delta") or {}).get("content")
                if piece:
                    now = time.perf_counter()
                    first = first or now
                    last = now
                    text.append(piece)
    n_tok = int(usage["completion_tokens"]) if usage else len(text)
    rate = (n_tok - 1) / (last - first) if first and last and last > first and n_tok > 1 else float("nan")
    return rate, n_tok, _valid(case, "".join(text))


def _valid(case: str, text: str) -> bool:
    if case not in ("json_schema", "json_object"):
        return True
    try:
        value = json.loads(text)
    except ValueError:
        return False
    if case == "json_object":
        return isinstance(value, dict)
    import jsonschema

    try:
        jsonschema.validate(value, SCHEMA)
        return True
    except jsonschema.ValidationError:
        return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common_args(ap, repeats=3)  # --repeats N: N rounds over the prompts per case
    ap.add_argument("--tokens", type=int, default=192, help="max tokens per request (default 192)")
    ap.add_argument("--no-llama-server", action="store_true", help="skip the llama-server peer")
    args = ap.parse_args()
    model = model_path(args.model)
    info = machine_info(args.threads)
    print_machine(info)
    systems = []
    if not args.no_llama_server:
        ls = str(peer_binary("llama-server"))
        systems.append(("llama-server", [ls, "-m", str(model), "-t", str(args.threads), "-np", "1", "-c", "2048",
                                         "--no-webui"], "llama-server"))
    systems.append(("loramux", [sys.executable, "-m", "loramux", "serve", str(model), "--n-ctx", "2048",
                                "--threads", str(args.threads), "--parallel", "1"], "loramux"))
    cases = ["free", "json_schema", "json_object", "grammar"]
    results: dict[str, dict[str, Any]] = {}
    for label, argv, kind in systems:
        srv = Server(argv, kind, [])
        try:
            one(srv, "json_schema", PROMPTS[0], 8)  # warm-up (loramux builds its UTF-8 table once per model)
            cells: dict[str, list[tuple[float, int, bool]]] = {c: [] for c in cases}
            for _ in range(max(1, args.repeats)):
                for p in PROMPTS:
                    for c in cases:  # cases interleaved: drifts of a shared machine hit all alike
                        cells[c].append(one(srv, c, p, args.tokens))
                        print(f"{label} {c}: {cells[c][-1][0]:.1f} tok/s over {cells[c][-1][1]} tokens",
                              file=sys.stderr, flush=True)
        finally:
            srv.close()
        results[label] = {c: {"tok_s": median(r for r, _, _ in v), "tokens": median(n for _, n, _ in v),
                              "valid": sum(ok for _, _, ok in v), "runs": len(v), "raw": v} for c, v in cells.items()}
        print(f"{label}: " + ", ".join(f"{c} {results[label][c]['tok_s']:.1f}" for c in cases), file=sys.stderr)
    report(results, cases)
    dump_json(args.json, {"machine": info, "results": results, "args": vars(args)})


def report(results: dict[str, dict[str, Any]], cases: list[str]) -> None:
    ref = results.get("llama-server")
    rows = []
    for label, r in results.items():
        for c in cases:
            rows.append([label, c, fmt(r[c]["tok_s"]), fmt(r[c]["tokens"], 0), f"{r[c]['valid']}/{r[c]['runs']}",
                         fmt(ratio(r[c]["tok_s"], r["free"]["tok_s"]), 2) + "×",
                         fmt(ratio(r[c]["tok_s"], ref[c]["tok_s"]), 2) + "×" if ref and label != "llama-server"
                         else "–"])
    print_table("decode tokens/s, one request at a time (medians)",
                ["system", "case", "tok/s", "tokens", "valid", "vs free (same system)", "vs llama-server"], rows)


if __name__ == "__main__":
    main()
