"""Requests built to cost the server more than they are worth, against a real server and engine (tiny model):
each one is refused with a 400 naming the field and the budget, or fails alone with its budget named,
and a neighbour request still completes. Then a hypothesis fuzzer over regexes, GBNF grammars, JSON
schemas and tool schemas, each case in a worker process with a memory limit and a CPU allowance.

    LORAMUX_FUZZ_EXAMPLES=2000 pytest tests/test_adversarial.py -k fuzz    # longer: scripts/fuzz_grammars.py
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import grammar_fuzz as gf
import httpx
import pytest
import tinymodel
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_server import errbody, serving
from test_tools import FG_TAGS, FUNCTION_GEMMA

from loramux import _native as N
from loramux.engine import grammar as G
from loramux.errors import BackendError, GrammarError
from loramux.server.tool_formats import function_gemma as fg

EXAMPLES = int(os.environ.get("LORAMUX_FUZZ_EXAMPLES", "12"))
CPU_PER_CASE_S = float(os.environ.get("LORAMUX_FUZZ_CPU_S", "10"))  # a case's CPU allowance in the worker
NESTED = "((a?){10}){10}"  # 36 s of engine time for 4 tokens on Gemma 3 before the budgets


@pytest.fixture(scope="module")
def served(tiny_model: Path):
    with serving(tiny_model, parallel=2, n_ctx=512, max_scored_tokens=64, max_queue=6) as s:
        yield s


@pytest.fixture(scope="module")
def srv(served):
    return served[0]


@pytest.fixture(scope="module")
def fg_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with FunctionGemma's tags as single tokens and its template."""
    path = tmp_path_factory.mktemp("fgemma") / "fgemma.gguf"
    pieces, template = tinymodel.PIECES, tinymodel.CHAT_TEMPLATE
    tinymodel.PIECES, tinymodel.CHAT_TEMPLATE = pieces + FG_TAGS, FUNCTION_GEMMA
    try:
        tinymodel.write_tiny_model(path)
    finally:
        tinymodel.PIECES, tinymodel.CHAT_TEMPLATE = pieces, template
    return path


def _post(srv: object, body: dict, path: str = "/v1/completions") -> httpx.Response:
    return httpx.post(srv.url + path, json={"prompt": "the cat", "max_tokens": 4, **body}, timeout=120)


def _neighbour_completes(srv: object) -> None:
    r = _post(srv, {"max_tokens": 8, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, r.text


def _refused(r: httpx.Response, param: str, *words: str) -> None:
    assert r.status_code == 400, r.text
    err = errbody(r)
    assert err["param"] == param and err["code"] == "invalid_grammar", err
    for w in words:
        assert w in err["message"], err["message"]


# ------------------------------------------------------------------------------ compile budgets over HTTP
@pytest.mark.parametrize(("field", "param"), [
    ({"guided_regex": NESTED}, "guided_regex"),
    ({"structured_outputs": {"regex": NESTED}}, "structured_outputs.regex"),
    ({"grammar": 'root ::= (("a")?){20}){20}'.replace("){20}){20}", "){20}){20}")}, "grammar"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "string", "pattern": NESTED}}}}, "response_format"),
])
def test_nested_optional_repetitions_are_refused_and_a_neighbour_completes(srv, field, param):
    if "grammar" in field:
        field = {"grammar": 'root ::= ((("a")?){20}){20}'}
    _refused(_post(srv, field), param, "grammar_max_optional_run")
    _neighbour_completes(srv)


def test_wide_alternations_and_enums_are_refused(srv):
    alts = "root ::= " + " | ".join(f'"w{i}"' for i in range(32768))
    _refused(_post(srv, {"grammar": alts}), "grammar", "32768 alternatives", "grammar_max_alternatives")
    enum = {"type": "json_schema", "json_schema": {"name": "e", "strict": True, "schema": {
        "type": "object", "properties": {"v": {"enum": [f"s{i}" for i in range(24000)]}}, "required": ["v"],
        "additionalProperties": False}}}
    r = httpx.post(srv.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                           "max_tokens": 4, "response_format": enum}, timeout=120)
    _refused(r, "response_format", "24000 values")
    _neighbour_completes(srv)


@pytest.mark.parametrize(("field", "words"), [
    ({"grammar": 'root ::= "a"{²}'}, ["expecting an integer", "line 1, column 14"]),
    ({"grammar": 'root ::= "a"{' + "9" * 5000 + "}"}, ["grammar_max_repeat"]),
    ({"grammar": 'root ::= "a"\nx ::= "b" )'}, ["a ')' that closes nothing at line 2, column 11"]),
    ({"grammar": 'root ::= thing\n'}, ["'thing' is used but never defined"]),
    ({"guided_json": "[" * 100_000 + "]" * 100_000}, ["nests too deep"]),
])
def test_malformed_grammars_get_a_reason_and_a_position_not_a_500(srv, field, words):
    r = _post(srv, field)
    _refused(r, next(iter(field)), *words)


def test_deep_json_schemas_get_a_400(srv):
    deep: dict = {"type": "string"}
    for _ in range(200):
        deep = {"type": "array", "items": deep}
    _refused(_post(srv, {"guided_json": deep}), "guided_json", "nests more than")
    raw = '{"prompt": "x", "max_tokens": 2, "guided_json": ' + '{"a": ' * 100_000 + "1" + "}" * 100_000 + "}"
    r = httpx.post(srv.url + "/v1/completions", content=raw, headers={"Content-Type": "application/json"},
                   timeout=120)
    assert r.status_code == 400, r.text[:300]
    _neighbour_completes(srv)


# ------------------------------------------------------------------------------ FunctionGemma's call grammar
def test_function_gemma_grammar_grows_with_the_schema_not_its_depth(fg_model):
    """The 849-byte tool schema (lists of lists, 30 deep) once built a 1.68 GB grammar: now a few KB,
    compiled by llama.cpp; non-integer bounds are a GrammarError naming the tool."""
    schema = gf.deep_arrays(30)
    assert len(json.dumps(schema)) < 1000
    rules, tops, _ = fg.grammar_rules({"f": schema})
    sizes = [len(fg.grammar_rules({"f": gf.deep_arrays(d)})[0]) for d in (4, 8)]
    assert sizes[1] - sizes[0] < 2 * (sizes[0] - len(fg.grammar_rules({"f": gf.deep_arrays(0)})[0])), sizes
    import loramux as lm

    eng = lm.Engine.load(fg_model, n_ctx=256, n_threads=1, slots=0)
    try:
        G.Grammar(rules + f"\nroot ::= {tops['f']}\n", "tools").compile(eng.model).close()
    finally:
        eng.close()
    for bad in ({"minLength": 1.5}, {"maxLength": float("inf")}, {"maxLength": "3"}, {"minLength": -1},
                {"maxLength": 10**9}):
        with pytest.raises(GrammarError, match=r"tools \(f\).*whole number"):
            fg.grammar_rules({"f": {"type": "object", "properties": {"s": {"type": "string", **bad}}}})


def test_function_gemma_tool_schemas_over_http(fg_model):
    tools = [{"type": "function", "function": {"name": "f", "parameters": gf.deep_arrays(30)}}]
    bad = [{"type": "function", "function": {"name": "g", "parameters": {
        "type": "object", "properties": {"s": {"type": "string", "maxLength": 2.5}}}}}]
    with serving(fg_model, n_ctx=1024) as (s, _eng, _st):
        body = {"messages": [{"role": "user", "content": "w?"}], "max_tokens": 40, "tool_choice": "required"}
        r = httpx.post(s.url + "/v1/chat/completions", json={**body, "tools": tools}, timeout=120)
        assert r.status_code == 200, r.text
        r = httpx.post(s.url + "/v1/chat/completions", json={**body, "tools": bad}, timeout=120)
        assert r.status_code == 400 and "whole number" in errbody(r)["message"], r.text


# ------------------------------------------------------------------------------ the converter's cost
def _convert_colliding(n: int) -> int:
    schema = {"type": "object", "properties": {"a" + chr(0x4E00 + i): {} for i in range(n)}}
    schema["required"] = list(schema["properties"])
    return len(G.json_schema(schema, strict=False).gbnf)


def test_schema_conversion_of_colliding_names_is_linear():
    """5000 property names (the most a schema may have) that all escape to the rule name 'a-': upstream
    searched the numbers from 0 for each (quadratic: about 8 s of CPU with the GIL held; 0.15 s now).
    The conversion's own CPU time, measured in a child process, must stay under 2 s."""
    import subprocess
    import sys

    code = ("import resource, sys; sys.path[:0] = sys.argv[1:]; import test_adversarial as t; "
            "t._convert_colliding(10); cpu = resource.getrusage(resource.RUSAGE_SELF).ru_utime; "
            "n = t._convert_colliding(5000); print(n, resource.getrusage(resource.RUSAGE_SELF).ru_utime - cpu)")
    here = Path(__file__).resolve().parent
    r = subprocess.run([sys.executable, "-c", code, str(here), str(here.parent / "src")], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    size, cpu = r.stdout.split()
    assert int(size) > 5000 and float(cpu) < 2.0, r.stdout
    with pytest.raises(GrammarError, match="more than 5000 properties"):
        _convert_colliding(5001)


# ------------------------------------------------------------------------------ budgets while serving
@pytest.mark.parametrize("budget", ["grammar_token_seconds", "grammar_request_seconds"])
def test_a_grammar_over_its_time_budget_fails_alone(tiny_model, budget):
    """With a budget no grammar step can meet, every constrained request fails with the budget named
    (streamed or not) while an unconstrained neighbour, sent at the same time, completes."""
    with serving(tiny_model, parallel=2, n_ctx=512, **{budget: 1e-9}) as (s, _eng, _st):
        out: dict[str, httpx.Response] = {}
        t = threading.Thread(target=lambda: out.setdefault("attack", _post(s, {"guided_choice": ["cat", "dog"]})))
        t.start()
        _neighbour_completes(s)
        t.join(120)
        r = out["attack"]
        assert r.status_code == 400, r.text
        err = errbody(r)
        assert err["code"] == "grammar_budget_exceeded" and err["param"] == "guided_choice", err
        assert budget in err["message"]
        with httpx.stream("POST", s.url + "/v1/completions", json={"prompt": "the cat", "max_tokens": 4,
                                                                   "guided_regex": "[a-z]+", "stream": True},
                          timeout=120) as resp:
            text = "".join(resp.iter_text())
        assert "grammar_budget_exceeded" in text and "[DONE]" in text
        _neighbour_completes(s)


def test_scored_tokens_are_bounded_and_sequences_weigh_in_the_queue(served):
    srv, _eng, state = served
    r = _post(srv, {"prompt": "the cat sat on the mat " * 16, "echo": True, "logprobs": 5, "max_tokens": 1})
    assert r.status_code == 400 and errbody(r)["code"] == "scoring_budget_exceeded", r.text
    assert "max_scored_tokens" in errbody(r)["message"]
    r = _post(srv, {"prompt": "the cat", "echo": True, "logprobs": 2, "max_tokens": 2})
    assert r.status_code == 200 and r.json()["choices"][0]["logprobs"]["tokens"], r.text
    # the queue takes 2 + 6 requests; with 5 places held, one more request fits, four sequences do not
    held = [state.admit() for _ in range(5)]
    try:
        r = _post(srv, {"prompt": "the cat", "n": 4, "max_tokens": 2})
        assert r.status_code == 429 and errbody(r)["code"] == "queue_full", r.text
        assert _post(srv, {"prompt": "the cat", "n": 1, "max_tokens": 2}).status_code == 200
    finally:
        for t in held:
            t.release()
    assert _post(srv, {"prompt": "the cat", "n": 4, "max_tokens": 2}).status_code == 200
    _neighbour_completes(srv)


def test_a_refused_token_never_reaches_llama_grammar_accept(engine):
    """llama.cpp ends the process on a token its grammar refuses: accept checks first (a BackendError)."""
    g = G.regex("a+").compile(engine.model)
    try:
        with pytest.raises(BackendError, match="does not allow"):
            g.accept(3 + ord("z"))  # the byte token <0x7A> (they follow <unk>, <s>, </s>)
        g.accept(3 + ord("a"))  # an allowed one still advances it
        assert g.handle.allows(3 + ord("a")) and not g.handle.allows(3 + ord("z"))
    finally:
        g.close()
    assert isinstance(g.handle, N.GrammarHandle)


def test_a_garbage_collection_inside_a_grammar_step_is_not_charged_to_it(engine):
    """The grammar budgets charge the engine thread's CPU time in the grammar's own work: a full garbage
    collection of a large heap (here one made to take 0.3 s of CPU) that starts inside a step is not the
    grammar's, and must not fail the request under a 0.2 s token budget (work_clock.py)."""
    import dataclasses
    import gc
    import time

    g = G.regex("a+").compile(engine.model, dataclasses.replace(G.DEFAULT_LIMITS, token_seconds=0.2))
    real = g.handle

    class Collecting:  # the grammar's handle, with a garbage collection inside its accept
        def accept(self, token: int) -> None:
            gc.collect()
            real.accept(token)

        def __getattr__(self, name: str) -> object:
            return getattr(real, name)

    def slow(phase: str, _info: dict) -> None:
        t = time.thread_time()
        while phase == "start" and time.thread_time() - t < 0.3:
            pass

    gc.callbacks.append(slow)
    try:
        g.handle = Collecting()  # type: ignore[assignment]
        t0 = time.thread_time()
        g.accept(3 + ord("a"))
        assert time.thread_time() - t0 >= 0.3 and g.spent < 0.2, g.spent
    finally:
        gc.callbacks.remove(slow)
        g.handle = real
        g.close()


# ------------------------------------------------------------------------------ the fuzzer
@pytest.fixture(scope="module")
def fuzz_worker(fg_model: Path):
    w = gf.Worker(fg_model, wall_s=max(60.0, 4 * CPU_PER_CASE_S))
    yield w
    w.close()


@pytest.mark.parametrize("kind", gf.KINDS)
def test_fuzz_constraints_stay_within_budget(fuzz_worker, kind):
    """Every generated constraint is refused with a typed error or runs: never a crash, never past its
    memory limit or CPU allowance."""
    seen: list[str] = []

    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=EXAMPLES <= 50,
              suppress_health_check=list(HealthCheck))
    @given(spec=gf.CASES[kind], seed=st.integers(0, 1000))
    def case(spec: object, seed: int) -> None:
        got = fuzz_worker.run(kind, spec, seed)
        seen.append(got["outcome"])
        assert got["outcome"] in ("ok", "refused"), (kind, spec, got)
        assert got["cpu"] < CPU_PER_CASE_S, (kind, spec, got)

    case()
    assert len(seen) >= min(EXAMPLES, 5)
