"""Grammar engines side by side: llama.cpp's grammar sampler (what loramux runs) and llguidance, on the same
vocabulary, grammars and token paths.

For each grammar (the attacks of the security review beside ordinary constraints) and each engine: the
compile time, then along one valid output (the model's own tokens of a fixed text) the time to compute the
mask of allowed tokens over the whole vocabulary before each token, and to advance by it. llama.cpp's mask
is its grammar sampler's pass over every candidate (no lazy checks, no first-character narrowing: the
worst case a pass costs); loramux's row applies the first-character narrowing it uses; llguidance's is
`LLMatcher.compute_bitmask`. A mask that runs past `--cap` seconds stops that engine's path ("> cap").

    pip install llguidance                      # not a dependency of loramux: only this benchmark needs it
    python benchmarks/grammar_engines.py        # the embedded Gemma 3 270M's vocabulary (262,144 tokens)
    python benchmarks/grammar_engines.py --only choice500,json --repeats 5
    python benchmarks/grammar_engines.py --only nested20     # llama.cpp takes minutes for one chunk of it
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import numpy as np
from _common import common_args, dump_json, machine_info, median, model_path, print_machine, print_table

from loramux import _native as N
from loramux.engine import grammar as G
from loramux.engine.model import Model
from loramux.engine.regex_gbnf import gbnf_literal

SCHEMA = {"type": "object", "properties": {"title": {"type": "string", "maxLength": 40},
                                           "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
                                           "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4}},
          "required": ["title", "year", "tags"], "additionalProperties": False}


def cases() -> dict[str, tuple[str, str, str, str]]:
    """name -> (loramux GBNF, llguidance format, llguidance text, a valid output)."""
    choices = [f"option number {i}" for i in range(500)]
    alts = [f"w{i}" for i in range(32768)]
    enum = {"type": "object", "properties": {"v": {"enum": [f"s{i}" for i in range(24000)]}}, "required": ["v"],
            "additionalProperties": False}
    out: dict[str, tuple[str, str, str, str]] = {
        "json": (G.json_schema(SCHEMA).gbnf, "json_schema", json.dumps(SCHEMA),
                 '{"title": "A river valley", "year": 1987, "tags": ["history", "maps"]}'),
        "regex_date": (G.regex(r"\d{4}-\d{2}-\d{2}").gbnf, "regex", r"\d{4}-\d{2}-\d{2}", "2024-05-17"),
        "choice500": ("root ::= " + " | ".join(gbnf_literal(c) for c in choices), "choice", json.dumps(choices),
                      "option number 123"),  # flat, as loramux wrote a choice list before
        "choice500_tree": (G.choice(choices).gbnf, "choice", json.dumps(choices), "option number 123"),
        "nested10": (G.Grammar(_nested_gbnf(10), "bench").gbnf, "regex", "((a?){10}){10}", "aaaa"),
        "nested20": (G.Grammar(_nested_gbnf(20), "bench").gbnf, "regex", "((a?){20}){20}", "aaaa"),
        "gbnf32k": ("root ::= " + " | ".join(f'"{a}"' for a in alts), "choice", json.dumps(alts), "w12345"),
        "enum24k": ('root ::= "{\\"v\\": " (' + " | ".join(f'"\\"s{i}\\""' for i in range(24000)) + ') "}"',
                    "json_schema", json.dumps(enum), '{"v": "s12345"}'),
    }
    return out


def _nested_gbnf(n: int) -> str:
    """`((a?){n}){n}` as loramux's regex converter writes it (without its cost check, which refuses it)."""
    from loramux.engine.regex_gbnf import regex_to_gbnf

    return "root ::= " + regex_to_gbnf(f"((a?){{{n}}}){{{n}}}", param="bench")


def llama_cpp_path(model: Model, gbnf: str, path: list[int], cap: float, narrow: bool) -> dict[str, Any]:
    """Compile, then before each token of `path` the pass over the whole vocabulary, then accept it."""
    t0 = time.perf_counter()
    handle = N.GrammarHandle.create(model.handle, gbnf)
    out: dict[str, Any] = {"compile": time.perf_counter() - t0, "mask": [], "advance": [], "capped": False}
    g = G.ActiveGrammar(model, handle, "bench", narrows=narrow)
    ids = np.arange(model.n_vocab, dtype=np.int32)
    try:
        for tok in path:
            t0 = time.perf_counter()
            deadline = time.thread_time() + cap
            try:
                if narrow:
                    known = g.table.refused_by_first(handle.allowed_among(g.table.probes, deadline))
                    allowed = np.zeros(model.n_vocab, dtype=bool)
                    rest = np.flatnonzero(~known).astype(np.int32)
                    allowed[rest] = handle.allowed_among(rest, deadline)
                else:
                    allowed = handle.allowed_among(ids, deadline)
            except TimeoutError:
                out["capped"] = True
                break
            out["mask"].append(time.perf_counter() - t0)
            assert allowed[tok], f"the path's token {tok} is refused by llama.cpp's grammar"
            t0 = time.perf_counter()
            handle.accept(tok)
            out["advance"].append(time.perf_counter() - t0)
    finally:
        g.close()
    return out


def llguidance_path(tokenizer: Any, fmt: str, text: str, path: list[int], n_vocab: int) -> dict[str, Any]:
    import llguidance

    t0 = time.perf_counter()
    m = llguidance.LLMatcher(tokenizer, llguidance.grammar_from(fmt, text), log_level=0)  # type: ignore[arg-type]
    out: dict[str, Any] = {"compile": time.perf_counter() - t0, "mask": [], "advance": [], "capped": False,
                           "error": m.get_error() if m.is_error() else None}
    if out["error"]:
        return out
    for tok in path:
        t0 = time.perf_counter()
        mask = np.frombuffer(m.compute_bitmask(), dtype=np.uint32)
        out["mask"].append(time.perf_counter() - t0)
        if m.is_error():
            out["error"] = m.get_error()
            break
        assert mask[tok // 32] >> (tok % 32) & 1, f"the path's token {tok} is refused by llguidance"
        t0 = time.perf_counter()
        m.consume_token(tok)
        out["advance"].append(time.perf_counter() - t0)
    return out


def fmt_ms(xs: list[float]) -> str:
    return f"{1e3 * median(xs):.2f}" if xs else "–"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common_args(ap, repeats=3)
    ap.add_argument("--only", default=None, help="comma-separated case names (default: all)")
    ap.add_argument("--cap", type=float, default=10.0, help="seconds one llama.cpp mask may take (default 10)")
    args = ap.parse_args()
    try:
        import llguidance
        import llguidance.llamacpp
    except ImportError:
        raise SystemExit("this benchmark needs llguidance: pip install llguidance") from None
    info = machine_info(args.threads)
    info["llguidance"] = llguidance.get_version() if hasattr(llguidance, "get_version") else "?"
    print_machine(info)
    print(f"llguidance {info['llguidance']}")
    model = Model(model_path(args.model))
    t0 = time.perf_counter()
    tok = llguidance.llamacpp.lltokenizer_from_vocab(model.handle.vocab)
    t_tok = time.perf_counter() - t0
    t0 = time.perf_counter()
    G.gbnf('root ::= "x"').compile(model).close()  # loramux's per-model vocabulary tables, built once
    t_tables = time.perf_counter() - t0
    print(f"once per model: llguidance tokenizer {t_tok:.2f} s, loramux's vocabulary tables {t_tables:.2f} s")
    chosen = cases()
    # nested20 only when named: one chunk of llama.cpp's pass (4096 candidates, between two deadline checks)
    # takes minutes there
    wanted = args.only.split(",") if args.only else [k for k in chosen if k != "nested20"]
    chosen = {k: v for k, v in chosen.items() if k in wanted}
    rows, raw = [], {"tokenizer_s": t_tok, "tables_s": t_tables}
    for name, (gbnf, lfmt, ltext, output) in chosen.items():
        path = model.handle.tokenize(output, False, False)
        runs: dict[str, list[dict[str, Any]]] = {"llama.cpp": [], "llama.cpp + narrowing": [], "llguidance": []}
        for _ in range(args.repeats):
            runs["llama.cpp"].append(llama_cpp_path(model, gbnf, path, args.cap, narrow=False))
            runs["llama.cpp + narrowing"].append(llama_cpp_path(model, gbnf, path, args.cap, narrow=True))
            runs["llguidance"].append(llguidance_path(tok, lfmt, ltext, path, model.n_vocab))
        raw[name] = runs
        for engine, rs in runs.items():
            masks = [m for r in rs for m in r["mask"]]
            capped = any(r["capped"] for r in rs)
            err = next((r.get("error") for r in rs if r.get("error")), None)
            rows.append([name, engine, f"{1e3 * median([r['compile'] for r in rs]):.1f}",
                         (f"> {1e3 * args.cap:.0f}" if capped and not masks else fmt_ms(masks)) + (" (capped)" if capped else ""),
                         f"{1e3 * max(masks):.2f}" if masks else "–", fmt_ms([a for r in rs for a in r["advance"]]),
                         f"{len(path)}", (err or "")[:60]])
        print(f"  {name}: done", file=sys.stderr)
    print_table(f"per grammar: compile, then along {len(path)}-ish tokens of one valid output the mask over the "
                f"whole vocabulary ({model.n_vocab} tokens) and the advance, ms, medians of {args.repeats}",
                ["grammar", "engine", "compile", "mask median", "mask max", "advance", "tokens", "error"], rows)
    dump_json(args.json, {"machine": info, "raw": raw})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
