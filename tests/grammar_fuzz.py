"""Hostile constraints for tests/test_adversarial.py and scripts/fuzz_grammars.py: hypothesis strategies
for regexes, GBNF grammars, JSON schemas and tool schemas, and a worker process that runs each case
under a memory limit and reports its CPU time.

Each case goes the way a request's would: the constraint is turned into a grammar (the regex subset,
the GBNF check, the JSON-schema converter, FunctionGemma's call grammar), compiled on the tiny model
under the default budgets, and run for a few sampled tokens. The outcome is "ok" (it ran), "refused"
(a typed loramux error: a 400 on the server) or "crash" (anything else); the worker reports the CPU
seconds the case took, and the parent kills it when a case runs past its wall-clock allowance.

    python tests/grammar_fuzz.py MODEL      # the worker: JSON cases on stdin, one JSON answer a line
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from hypothesis import strategies as st

MEMORY_BYTES = 3 << 30  # the worker's address space: a grammar that explodes in memory fails here
KINDS = ("regex", "gbnf", "schema", "tool")

# ------------------------------------------------------------------------------ strategies

_count = st.integers(0, 12)
_atom_re = st.sampled_from(["a", "b", ".", "[a-c]", "\\d", "[^a]", "ab", "\\w"])


def _quant_re(inner: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    q = st.one_of(st.sampled_from(["?", "*", "+", ""]), _count.map(lambda n: f"{{{n}}}"),
                  st.tuples(_count, _count).map(lambda t: f"{{{min(t)},{max(t)}}}"))
    return st.tuples(inner, q).map(lambda t: f"({t[0]}){t[1]}" if t[1] else t[0])


regexes = st.recursive(_atom_re, lambda inner: st.one_of(
    _quant_re(inner),
    st.lists(inner, min_size=2, max_size=4).map("".join),
    st.lists(inner, min_size=2, max_size=3).map(lambda xs: "(" + "|".join(xs) + ")"),
), max_leaves=12)

_atom_gbnf = st.sampled_from(['"a"', '"ab"', '""', "[a-c]", "[^x]", ".", "r1", "r2"])


def _quant_gbnf(inner: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    q = st.one_of(st.sampled_from(["?", "*", "+", ""]), st.integers(0, 30).map(lambda n: f"{{{n}}}"),
                  st.tuples(_count, st.integers(0, 2000)).map(lambda t: f"{{{t[0]},{t[1]}}}"),
                  st.sampled_from(["{²}", "{9999999999999}", "{3,1}", "{", "{,2}"]))
    return st.tuples(inner, q).map(lambda t: f"({t[0]}){t[1]}")


_gbnf_expr = st.recursive(_atom_gbnf, lambda inner: st.one_of(
    _quant_gbnf(inner),
    st.lists(inner, min_size=2, max_size=4).map(" ".join),
    st.lists(inner, min_size=2, max_size=3).map(lambda xs: "(" + " | ".join(xs) + ")"),
), max_leaves=12)
gbnfs = st.one_of(
    st.tuples(_gbnf_expr, _gbnf_expr, _gbnf_expr).map(
        lambda t: f"root ::= {t[0]}\nr1 ::= {t[1]}\nr2 ::= {t[2]} | \"z\"\n"),
    st.tuples(_gbnf_expr, st.text(alphabet='"[]()|*+?{},:=#\\\n rx0a', max_size=24)).map(
        lambda t: f"root ::= {t[0]} {t[1]}\nr1 ::= \"a\"\nr2 ::= \"b\"\n"),
    st.integers(1, 40000).map(lambda n: "root ::= " + " | ".join(f'"w{i}"' for i in range(n))),
)

_bound = st.one_of(st.integers(-2, 40), st.sampled_from([1.5, 10**9, -1, "3", None, float("inf"), True, 2000]))
_names = st.sampled_from(["a", "b", "a!", "a@", "a-", "ä", "a b", "name", "x1", "$ref"])


def _maybe(d: dict[str, Any], key: str, value: Any) -> dict[str, Any]:
    return {**d, key: value} if value is not None else d


_leaf_schema = st.one_of(
    st.tuples(st.one_of(st.none(), regexes), _bound, _bound).map(
        lambda t: _maybe(_maybe(_maybe({"type": "string"}, "pattern", t[0]), "minLength", t[1]), "maxLength", t[2])),
    st.tuples(st.one_of(st.none(), st.integers(-10**6, 10**6)), st.one_of(st.none(), st.integers(-10**6, 10**6)))
    .map(lambda t: _maybe(_maybe({"type": "integer"}, "minimum", t[0]), "maximum", t[1])),
    st.sampled_from([{"type": "boolean"}, {"type": "null"}, {"type": "number"}, {}, True]),
    st.integers(1, 3000).map(lambda n: {"enum": [f"v{i}" for i in range(n)]}),
)
schemas = st.recursive(_leaf_schema, lambda inner: st.one_of(
    st.tuples(inner, _bound, _bound).map(
        lambda t: _maybe(_maybe({"type": "array", "items": t[0]}, "minItems", t[1]), "maxItems", t[2])),
    st.tuples(st.dictionaries(_names, inner, max_size=5), st.booleans()).map(
        lambda t: {"type": "object", "properties": t[0], **({"required": list(t[0])} if t[1] else {})}),
    st.lists(inner, min_size=1, max_size=3).map(lambda xs: {"anyOf": xs}),
), max_leaves=10)


def deep_arrays(depth: int) -> dict[str, Any]:
    """A list of lists ... `depth` deep: the tool schema that once doubled FunctionGemma's grammar per level."""
    node: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        node = {"type": "array", "items": node}
    return {"type": "object", "properties": {"x": node}, "required": ["x"]}


tool_schemas = st.one_of(schemas, st.integers(1, 40).map(deep_arrays))
CASES = {"regex": regexes, "gbnf": gbnfs, "schema": schemas, "tool": tool_schemas}


# ------------------------------------------------------------------------------ the worker

def build(kind: str, spec: Any) -> Any:
    """The Grammar a request with this constraint would be given (see the module docstring)."""
    from loramux.engine import grammar as G
    from loramux.server import tool_formats
    from loramux.server.schemas import Tool

    if kind == "regex":
        return G.regex(spec, "guided_regex")
    if kind == "gbnf":
        return G.gbnf(spec, "grammar")
    if kind == "schema":
        return G.json_schema(spec, param="response_format", strict=False)
    tool = Tool.model_validate({"type": "function", "function": {"name": "f", "parameters": spec}})
    # FunctionGemma's call grammar, as a forced call (tool_choice required) gets it
    return tool_formats.forcing_grammar(tool_formats.FORMATS["function_gemma"], [tool], parallel=False)


def run_case(engine: Any, kind: str, spec: Any, seed: int) -> dict[str, Any]:
    from loramux.errors import LoramuxError

    t0 = time.process_time()
    out: dict[str, Any] = {"outcome": "ok"}
    try:
        grammar = build(kind, spec).compile(engine.model)
        engine.generate("the cat", grammar=grammar, max_tokens=8, temperature=1.0, seed=seed)
    except LoramuxError as e:
        out = {"outcome": "refused", "error": type(e).__name__, "message": str(e)[:300]}
    except Exception as e:  # noqa: BLE001 - the point: anything untyped is a finding
        out = {"outcome": "crash", "error": type(e).__name__, "message": str(e)[:300]}
    out["cpu"] = time.process_time() - t0
    return out


def worker(model: str) -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_BYTES, MEMORY_BYTES))
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
    import loramux as lm

    engine = lm.Engine.load(model, n_ctx=256, n_parallel=1, n_threads=1, slots=0)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        case = json.loads(line)
        try:
            answer = run_case(engine, case["kind"], case["spec"], case.get("seed", 0))
        except MemoryError:
            answer = {"outcome": "crash", "error": "MemoryError", "cpu": -1}
        print(json.dumps(answer), flush=True)


class Worker:
    """The parent's end: one worker process, restarted after a case that killed it or ran too long."""

    def __init__(self, model: Path, wall_s: float) -> None:
        self.model, self.wall_s = model, wall_s
        self.proc: subprocess.Popen[str] | None = None

    def _start(self) -> subprocess.Popen[str]:
        env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
        proc = subprocess.Popen([sys.executable, __file__, str(self.model)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
        assert proc.stdout is not None
        assert json.loads(proc.stdout.readline()).get("ready")
        return proc

    def run(self, kind: str, spec: Any, seed: int = 0) -> dict[str, Any]:
        """The case's answer, or {"outcome": "timeout"/"died"} (the worker is then restarted)."""
        import select

        if self.proc is None or self.proc.poll() is not None:
            self.proc = self._start()
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"kind": kind, "spec": spec, "seed": seed}) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], self.wall_s)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            outcome = "timeout" if not ready else "died"
            self.close()
            return {"outcome": outcome}
        return dict(json.loads(line))

    def close(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


if __name__ == "__main__":
    worker(sys.argv[1])
