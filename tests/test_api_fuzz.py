"""Property-based fuzz of the HTTP API from its own OpenAPI schema (schemathesis), against a live server on
127.0.0.1 (real uvicorn, real llama.cpp, the tiny model) with both keys configured, so the admin endpoints
are exercised too.

Every operation of `app.openapi()` gets cases that fit the schema (positive) and, for bodies, cases that
break it (negative). Each case may also be steered towards what the server actually serves (the served
model and adapter names, the control vector, the adapter file) and may have one string replaced by a
hostile one (lone surrogates, NUL, over-long file names, '~user', template syntax...), so the cases reach
the engine and the file system, not only the validators. A sweep then puts every hostile string into
every string field, and edge numbers into every number field, of one complete valid body per operation
(random cases rarely put a given value in a given field). Checked on every response: no 5xx (also none
inside an SSE stream), no hang (each request under a client timeout), error bodies in the shape of the protocol
serving the path (OpenAI's, Anthropic's on /v1/messages, Ollama's on /api/, llama-server's on its native routes).
Afterwards the server is healthy, has no request or sequence left over, and serves the base and its
adapters bit-identically to before the run.

Bounded: fixed seed (derandomize), a fixed number of cases per operation, a client timeout per request and
a time budget for the whole run (past it, the remaining cases are not sent; the count is printed).
LORAMUX_FUZZ_SCALE=N multiplies the number of cases for a longer run by hand.
"""

from __future__ import annotations

import copy
import json
import os
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import requests
from tinymodel import vocab, write_tiny_lora

import loramux as lm
from loramux.gguf_io import write_control_vector
from loramux.server import LoraEntry, ServerSettings, create_app, serve_in_thread
from loramux.server.config import ControlEntry

schemathesis = pytest.importorskip("schemathesis", reason="schemathesis is in the dev extra")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import FailureGroup, not_a_server_error  # noqa: E402

KEY, ADMIN = "fuzz-inference-key", "fuzz-admin-key"
PINNED = ("fz-one", "fz-two")  # names the fuzzer never sends to unload (it only steers towards HOT)
HOT = "fz-hot"  # the adapter the steered load/unload cases come and go with
CV = "fz-cv"
SCALE = max(1, int(os.environ.get("LORAMUX_FUZZ_SCALE", "1")))
# cases per operation: GETs take no input; bodies get schema-conforming and schema-breaking ones
N_GET, N_POSITIVE, N_NEGATIVE = 8 * SCALE, 80 * SCALE, 30 * SCALE
BUDGET_S = 240.0 * SCALE  # past this the remaining cases are not sent (CI fits well inside; see the print)
TIMEOUT_S = 60.0  # per request: a response slower than this is a hang
HOSTILE = ["\ud800", "a\udc00b", "\x00", "a\x00.gguf", "x" * 300 + ".gguf", "~no-such-user-here/a.gguf",
           "../" * 8 + "etc/passwd", "hf://a/b/c.gguf@../../x", "https://127.0.0.1:1/a.gguf",
           "{{ raise('x') }}{% for %}", "<start_of_turn>", "\u202e\u0301", "😀" * 50, "", "\n" * 64, "junk.gguf"]
WORDS = ["the", "cat", "sat", "on", "mat", "dog", "hello", "world", "<start_of_turn>", "é", "😀"]
N_VOCAB = len(vocab()[0])  # the tiny model's
EDGE_NUMBERS = [0, -1, 2**31, 2**32 - 1, 2**64, -(2**63) - 1, 10**30, 1e308, -1e308, 5e-324, -0.0, 0.5]
# one complete valid body per operation: the sweep puts each hostile value into each of their fields
TEMPLATES: list[tuple[str, Any]] = [
    ("/v1/completions", {"model": "tiny", "prompt": "the cat", "max_tokens": 4, "temperature": 0.7, "top_p": 0.9,
                         "top_k": 40, "min_p": 0.05, "repeat_penalty": 1.1, "frequency_penalty": 0.1,
                         "presence_penalty": 0.1, "seed": 7, "stop": ["x", "mat"], "user": "u",
                         "lora": [{"name": PINNED[0], "scale": 0.5}, {"id": 1, "scale": -0.5}],
                         "control_vector": {"name": CV, "strength": 0.5}, "stream": True,
                         "stream_options": {"include_usage": True}}),
    ("/v1/completions", {"model": PINNED[1], "prompt": [[5, 6, 7]], "max_tokens": 3}),
    ("/v1/chat/completions", {"model": PINNED[0], "max_completion_tokens": 4, "stop": "x", "seed": 3,
                              "messages": [{"role": "system", "content": "be brief", "name": "s"},
                                           {"role": "user", "content": [{"type": "text", "text": "hello"}]}]}),
    ("/v1/load_lora_adapter", {"lora_name": HOT, "lora_path": f"{HOT}.gguf", "scale": 0.5, "replace": True}),
    ("/v1/unload_lora_adapter", {"lora_name": HOT, "lora_int_id": 2}),
    ("/lora-adapters", [{"id": 0, "scale": 0.0}, {"id": 1, "scale": 0.0}]),
    ("/v1/messages", {"model": PINNED[0], "max_tokens": 4, "system": "be brief", "stop_sequences": ["x"],
                      "temperature": 0.5, "top_k": 4, "metadata": {"user_id": "u"}, "stream": True,
                      "messages": [{"role": "user", "content": [{"type": "text", "text": "hello"}]}],
                      "lora": [{"name": PINNED[1], "scale": 0.5}]}),
    ("/v1/messages/count_tokens", {"model": "tiny", "messages": [{"role": "user", "content": "hello"}]}),
    ("/v1/responses", {"model": PINNED[1], "input": [{"role": "user", "content": [{"type": "input_text",
                                                                                   "text": "hi"}]}],
                       "instructions": "be brief", "max_output_tokens": 4, "temperature": 0.5, "stream": True,
                       "prompt_cache_key": "k", "metadata": {"a": "b"}}),
    ("/api/chat", {"model": "tiny:" + PINNED[0], "messages": [{"role": "user", "content": "hello"}],
                   "options": {"num_predict": 4, "temperature": 0.5, "seed": 3, "stop": ["x"]}, "keep_alive": "5m"}),
    ("/api/generate", {"model": "tiny", "prompt": "the cat", "system": "s", "stream": False,
                       "options": {"num_predict": 4, "top_k": 4}}),
    ("/api/show", {"model": PINNED[1], "verbose": False}),
    # llama-server's native API (protocols/llama_server.py)
    ("/completion", {"prompt": [1, "the cat", 5], "n_predict": 4, "temperature": 0.5, "top_k": 4, "seed": 3,
                     "n_probs": 2, "return_tokens": True, "stream": True, "timings_per_token": True,
                     "cache_prompt": True,
                     "id_slot": -1, "stop": ["x"], "logit_bias": [[5, -1.0], ["cat", False]],
                     "lora": [{"id": 0, "scale": 0.5}]}),
    ("/infill", {"input_prefix": "the", "input_suffix": "mat", "prompt": "cat",
                 "input_extra": [{"filename": "f.txt", "text": "dog"}], "n_predict": 3,
                 "response_fields": ["content", "generation_settings/n_predict"]}),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "n_predict": 3,
                              "n_probs": 2, "logit_bias": {"5": 1.5, "cat": False}, "timings_per_token": True,
                              "stream": True}),
    ("/apply-template", {"messages": [{"role": "user", "content": "hello"}]}),
    ("/chat/completions/input_tokens", {"messages": [{"role": "user", "content": "hello"}]}),
]
CHECK_PROMPT = [1]  # one token: never reuses a cached prefix, so before and after compute alike


@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("fuzz")
    for i, name in enumerate((*PINNED, HOT)):
        write_tiny_lora(d / f"{name}.gguf", seed=70 + i, rank=4)
    (d / "junk.gguf").write_bytes(bytes(range(256)) * 4)  # inside the adapter dir, not a GGUF
    rng = np.random.default_rng(0)
    write_control_vector(d / "cv.gguf", {1: rng.standard_normal(64).astype(np.float32)}, "llama", 2)
    return d


def _steer(body: Any, draw: Any) -> None:
    """Point a case at what the server serves, so it gets past the name lookups (in place)."""
    if not isinstance(body, dict):
        return
    names = ["tiny", *PINNED, HOT]
    if "model" in body:
        body["model"] = draw(st.sampled_from(names))
    if isinstance(body.get("lora"), list):
        for ref in body["lora"]:
            if isinstance(ref, dict) and "name" in ref:
                ref["name"] = draw(st.sampled_from(names))
    if isinstance(body.get("control_vector"), dict):
        body["control_vector"]["name"] = CV
    if "prompt" in body:  # text or token ids the model has: the rest of the case decides what happens
        body["prompt"] = draw(st.one_of(st.lists(st.sampled_from(WORDS), min_size=1, max_size=12).map(" ".join),
                                        st.lists(st.integers(1, N_VOCAB - 1), min_size=1, max_size=12)))
    for k in ("max_tokens", "max_completion_tokens"):
        if k in body or "prompt" in body:
            body[k] = draw(st.none() | st.integers(0, 24)) if k in body else draw(st.integers(0, 24))
    if "lora_name" in body:
        body["lora_name"] = HOT
    if "lora_path" in body:
        body["lora_path"] = f"{HOT}.gguf"
    for k in ("n", "best_of", "logprobs", "top_logprobs", "echo", "suffix", "logit_bias", "tools", "functions",
              "tool_choice", "response_format"):
        body.pop(k, None)  # refused by design (400): without them the case reaches the engine


def _leaves(value: Any, path: tuple = ()) -> list[tuple]:
    """Paths to every string and number inside a JSON value (booleans are not numbers here)."""
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in _leaves(v, (*path, k))]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in _leaves(v, (*path, i))]
    return [path] if isinstance(value, (str, int, float)) and not isinstance(value, bool) else []


def _get(value: Any, path: tuple) -> Any:
    for k in path:
        value = value[k]
    return value


def _put(value: Any, path: tuple, new: Any) -> Any:
    """`value` with the leaf at `path` replaced by `new` (in place; the root itself when path is empty)."""
    if not path:
        return new
    _get(value, path[:-1])[path[-1]] = new
    return value


def _hostile(body: Any, draw: Any) -> Any:
    """Replace one string of the body with a hostile string."""
    paths = [p for p in _leaves(body) if isinstance(_get(body, p), str)]
    if not paths:
        return body
    return _put(body, draw(st.sampled_from(paths)), draw(st.sampled_from(HOSTILE)))


def _protocol_sse_problem(text: str, path: str) -> str | None:
    """Anthropic's and the Responses API's streams: they end with their own last event, and a failure inside
    them is their error event (a server error there is a failure of the server)."""
    events = [json.loads(ln[6:]) for ln in text.splitlines() if ln.startswith("data: ")]
    last = events[-1].get("type") if events else None
    ends = ("message_stop", "error") if path.startswith("/v1/messages") else \
        ("response.completed", "response.incomplete", "response.failed")
    if last not in ends:
        return f"the stream does not end with {' or '.join(ends)}: {events[-2:]}"
    for e in events:
        err = e.get("error") if isinstance(e.get("error"), dict) else e if e.get("type") == "error" else None
        if err and err.get("type") in ("api_error", "server_error") or (err and str(err.get("code")) == "internal_error"):
            return f"server error inside the stream: {e}"
    return None


def _shape_problem(r: requests.Response, path: str) -> str | None:
    """An error body not in the shape of the protocol serving `path`."""
    try:
        body = r.json()
        if path.startswith("/v1/messages"):
            assert body["type"] == "error" and isinstance(body["error"]["message"], str) and body["error"]["type"]
        elif path.startswith("/api/"):
            assert set(body) == {"error"} and isinstance(body["error"], str) and body["error"]
        else:
            err = body["error"]
            assert isinstance(err["message"], str) and err["message"] and {"type", "param", "code"} <= set(err)
    except (ValueError, KeyError, TypeError, AssertionError):
        return f"{r.status_code} without the protocol's error shape: {r.text[:300]}"
    return None


def _native_sse_problem(text: str) -> str | None:
    """llama-server's native stream: it ends with the object that has `stop: true`, or an error (no [DONE])."""
    events = [json.loads(ln[6:]) for ln in text.splitlines() if ln.startswith("data: ")]
    last = events[-1] if events else {}
    if not (last.get("stop") is True or isinstance(last.get("error"), dict)):
        return f"the stream does not end with stop: true: {events[-2:]}"
    if isinstance(last.get("error"), dict) and last["error"].get("code", 0) >= 500:
        return f"server error inside the stream: {last}"
    return None


def _sse_problem(text: str) -> str | None:
    """A server error sent inside an event stream (after its 200), or a stream that does not end."""
    lines = [ln for ln in text.splitlines() if ln]
    if not lines or lines[-1] != "data: [DONE]":
        return f"the stream does not end with [DONE]: {lines[-2:]}"
    for ln in lines[:-1]:
        event = json.loads(ln.removeprefix("data: "))
        if isinstance(event, dict) and "error" in event and event["error"].get("type") == "server_error":
            return f"server error inside the stream: {event}"
    return None


def _not_supported(r: requests.Response) -> bool:
    """llama-server's 501 `not_supported_error` (/infill on a vocabulary without FIM tokens, POST /props, the
    slot actions): a deliberate answer, not a failure."""
    try:
        return r.status_code == 501 and r.json()["error"]["type"] == "not_supported_error"
    except (ValueError, KeyError, TypeError):
        return False


def _problem(r: requests.Response) -> str | None:
    """What is wrong with one response, or None."""
    if r.status_code >= 500 and not _not_supported(r):
        return f"{r.status_code}: {r.text[:300]}"
    ctype = r.headers.get("content-type", "")
    path = requests.utils.urlparse(r.url).path
    if r.status_code == 200 and ctype.startswith("text/event-stream"):
        if path.startswith(("/v1/messages", "/v1/responses")):
            return _protocol_sse_problem(r.text, path)
        if path.startswith(("/completion", "/infill")):
            return _native_sse_problem(r.text)
        return _sse_problem(r.text)
    if r.status_code == 200 and ctype.startswith("application/x-ndjson"):  # Ollama's stream
        last = json.loads(r.text.splitlines()[-1])
        return None if last.get("done") or isinstance(last.get("error"), str) else f"the stream does not end: {last}"
    if r.status_code >= 400 and r.request.method != "HEAD":
        return _shape_problem(r, path)
    return None


class Fuzz:
    """Runs the cases of one operation and keeps the tally."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.session = requests.Session()
        self.statuses: Counter[tuple[str, str, int]] = Counter()
        self.failures: list[str] = []
        self.skipped = 0
        self.deadline = time.monotonic() + BUDGET_S

    def run(self, op: Any, mode: GenerationMode, n: int) -> None:
        auth = st.sampled_from([ADMIN] * 6 + [KEY] * 2 + [None, "wrong-key"])

        @settings(max_examples=n, derandomize=True, database=None, deadline=None, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck))
        @given(case=op.as_strategy(generation_mode=mode), key=auth, steer=st.integers(0, 3),
               hostile=st.integers(0, 4), data=st.data())
        def one(case: Any, key: str | None, steer: int, hostile: int, data: Any) -> None:
            if time.monotonic() > self.deadline:
                self.skipped += 1
                return
            body = copy.deepcopy(case.body)  # the case itself stays as generated (schemathesis checks it)
            if steer:  # three cases in four are steered
                _steer(body, data.draw)
            if hostile == 0 and op.body:  # one case in five carries a hostile string
                body = _hostile(body, data.draw)
            self.send(op, case, body, key)
        one()

    def send(self, op: Any, case: Any, body: Any, key: str | None) -> None:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        kwargs = case.as_transport_kwargs(base_url=self.url, headers=headers)
        if op.body and body != case.body:  # steered or hostile: send what it became, as JSON
            kwargs.pop("data", None)
            kwargs["json"] = body
        shown = json.dumps(body, default=repr)[:400] if op.body else ""
        what = f"{op.method.upper()} {op.path} {shown}"
        try:
            r = self.session.request(**kwargs, timeout=TIMEOUT_S)
        except requests.Timeout:
            self.failures.append(f"{what}: no response within {TIMEOUT_S:.0f} s (a hang)")
            return
        except requests.ConnectionError as e:
            self.failures.append(f"{what}: connection failed ({e})")
            return
        self.statuses[(op.method.upper(), op.path, r.status_code)] += 1
        problem = _problem(r)
        try:  # schemathesis's own check too (but for llama-server's deliberate 501s)
            if not _not_supported(r):
                case.validate_response(r, checks=[not_a_server_error])
        except FailureGroup as e:
            problem = problem or f"schemathesis: {e.exceptions[0]}"
        self.note(what, problem)

    def note(self, what: str, problem: str | None) -> None:
        if problem is not None:
            self.failures.append(f"{what}\n    -> {problem}")

    def sweep(self) -> None:
        """Every hostile string into every string field, and edge numbers into every number field, of one
        complete valid body per operation (the random cases rarely put a given value in a given field)."""
        for path, template in TEMPLATES:
            for leaf in _leaves(template):
                for bad in HOSTILE if isinstance(_get(template, leaf), str) else EDGE_NUMBERS:
                    if time.monotonic() > self.deadline:
                        self.skipped += 1
                        continue
                    body = _put(copy.deepcopy(template), leaf, bad)
                    shown = json.dumps(body, default=repr)[:400]
                    try:
                        r = self.session.post(self.url + path, json=body, timeout=TIMEOUT_S,
                                              headers={"Authorization": f"Bearer {ADMIN}"})
                    except requests.RequestException as e:
                        self.note(f"POST {path} {shown}", f"{type(e).__name__}: {e} (a hang or a dropped connection)")
                        continue
                    self.statuses[("POST", path + " (sweep)", r.status_code)] += 1
                    self.note(f"POST {path} {shown}", _problem(r))


def _reference(url: str) -> dict[str, str]:
    """Greedy outputs of the base, an adapter and a stack, each request alone."""
    bodies = {"base": {"model": "tiny", "lora": []}, "adapter": {"model": PINNED[0]},
              "stack": {"model": "tiny", "lora": [{"name": PINNED[0], "scale": 0.5},
                                                  {"name": PINNED[1], "scale": -0.7}]}}
    out = {}
    for name, extra in bodies.items():
        body = {"prompt": CHECK_PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True, **extra}
        r = httpx.post(url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                       timeout=TIMEOUT_S)
        assert r.status_code == 200, (name, r.text)
        out[name] = r.json()["choices"][0]["text"]
    return out


def _wait_idle(eng: lm.Engine, state: Any, timeout: float = 60.0) -> None:
    """Every request the fuzz sent has finished and given back its sequence, queue place and adapters."""
    deadline = time.monotonic() + timeout
    while True:
        s = eng.scheduler.snapshot()
        busy = s.running + s.waiting + state.in_flight + sum(e.inflight for e in state.pool.entries.values())
        if not busy or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert busy == 0, (s, state.in_flight, {e.name: e.inflight for e in state.pool.entries.values()})


@pytest.mark.slow
@pytest.mark.timeout(540)
def test_fuzz_the_api_from_its_openapi_schema(tiny_model: Path, fuzz_dir: Path) -> None:
    eng = lm.Engine.load(tiny_model, n_ctx=256, n_parallel=2, n_threads=1, slots=0)
    entries = tuple(LoraEntry(n, str(fuzz_dir / f"{n}.gguf")) for n in PINNED)
    for e in entries:
        eng.load_lora(e.source, e.name)
    cfg = ServerSettings(loras=entries, adapter_dirs=(str(fuzz_dir),), parallel=2, n_ctx=256, api_key=KEY,
                         admin_api_key=ADMIN, control_vectors=(ControlEntry(CV, str(fuzz_dir / "cv.gguf")),))
    app = create_app(eng, cfg, own_engine=True)
    schema = schemathesis.openapi.from_dict(app.openapi())  # the schema FastAPI derives from the routes
    ops = [op.ok() for op in schema.get_all_operations()]
    assert {(o.method.upper(), o.path) for o in ops} >= {
        ("GET", "/health"), ("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
        ("POST", "/v1/load_lora_adapter"), ("POST", "/v1/unload_lora_adapter"), ("POST", "/lora-adapters"),
        ("POST", "/v1/messages"), ("POST", "/v1/messages/count_tokens"), ("POST", "/v1/responses"),
        ("POST", "/api/chat"), ("POST", "/api/generate"), ("POST", "/api/show"), ("GET", "/api/tags"),
        ("POST", "/completion"), ("POST", "/infill"), ("GET", "/props"), ("GET", "/slots")}
    started = time.monotonic()
    with serve_in_thread(app) as srv:
        before = _reference(srv.url)
        fuzz = Fuzz(srv.url)
        fuzz.sweep()
        for op in ops:
            if op.body:
                fuzz.run(op, GenerationMode.POSITIVE, N_POSITIVE)
                fuzz.run(op, GenerationMode.NEGATIVE, N_NEGATIVE)
            else:
                fuzz.run(op, GenerationMode.POSITIVE, N_GET)
        _wait_idle(eng, app.state.lm)
        assert httpx.get(srv.url + "/health").json() == {"status": "ok"}
        after = _reference(srv.url)
    took = time.monotonic() - started
    sent = sum(fuzz.statuses.values())
    tally = ", ".join(f"{m} {p} {s}: {n}" for (m, p, s), n in sorted(fuzz.statuses.items()))
    print(f"\nfuzz: {sent} cases in {took:.0f} s ({fuzz.skipped} not sent past the budget)\n{tally}")
    assert not fuzz.failures, f"{len(fuzz.failures)} failures:\n" + "\n".join(fuzz.failures[:20])
    assert after == before, (before, after)
    assert len(set(before.values())) == 3  # the adapters change the output: the comparison can fail
    generated = sum(n for (m, p, s), n in fuzz.statuses.items() if s == 200 and "completions" in p)
    assert generated > 0 and any(s == 200 for (m, p, s) in fuzz.statuses if p == "/v1/load_lora_adapter")
