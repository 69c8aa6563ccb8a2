"""llama-server's other sampler and limit fields (server/llama_samplers.py, engine/linestops.py) and the bodies
its editor plugins send, against a real uvicorn on 127.0.0.1 over real llama.cpp (the tiny FIM model)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from test_server import adir, serving  # noqa: F401 - adir is a fixture
from tinymodel import write_tiny_model

PROMPT = "the cat sat on the mat"
FORCED = "x\n    y\n  z\nw"  # what the grammar below makes the output
GRAMMAR = 'root ::= "x\\n    y\\n  z\\nw"'
TIMINGS = ["timings/prompt_n", "timings/prompt_ms", "timings/prompt_per_token_ms", "timings/prompt_per_second",
           "timings/predicted_n", "timings/predicted_ms", "timings/predicted_per_token_ms",
           "timings/predicted_per_second"]


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory, adir: Path):  # noqa: F811 - the fixture imported above
    model = write_tiny_model(tmp_path_factory.mktemp("fim") / "fim.gguf", fim=True)
    with serving(model, adir) as s:
        yield s


def post(s, path: str, body: dict) -> httpx.Response:
    return httpx.post(s[0].url + path, json=body, timeout=120)


def llama_vim_fim(**over) -> dict:
    """llama.vim's FIM request (autoload/llama.vim, llama#fim), field for field."""
    body = {"input_prefix": "def f(x):\n", "input_suffix": "\n\nprint(f(2))\n",
            "input_extra": [{"text": "import os\n", "time": [1733, 120000], "filename": "a.py"}],
            "prompt": "    ", "n_predict": 16, "stop": [], "n_indent": 4, "top_k": 40, "top_p": 0.90,
            "stream": False, "samplers": ["top_k", "top_p", "infill"], "cache_prompt": True,
            "t_max_prompt_ms": 500, "t_max_predict_ms": 250,
            "response_fields": ["content", *TIMINGS, "truncated", "tokens_cached"]}
    return {**body, **over}


def test_llama_vim_bodies_answered_in_llama_servers_shape(srv):
    """llama.vim's FIM body and its ring-buffer warm-up body are accepted; the answer holds exactly the
    response_fields asked for; the same body without n_indent and t_max_predict_ms and with ignore_eos
    generates the n_predict tokens."""
    r = post(srv, "/infill", llama_vim_fim())
    assert r.status_code == 200, r.text
    out = r.json()
    assert set(out) == {"content", *TIMINGS, "truncated", "tokens_cached"}
    assert isinstance(out["content"], str) and out["timings/prompt_n"] > 0 and out["truncated"] is False
    warm = {"input_prefix": "", "input_suffix": "", "input_extra": [{"text": "x = 1\n", "time": [1, 2],
            "filename": "b.py"}], "prompt": "", "n_predict": 0, "temperature": 0.0, "stream": False,
            "samplers": [], "cache_prompt": True, "t_max_prompt_ms": 1, "t_max_predict_ms": 1,
            "response_fields": [""]}
    w = post(srv, "/infill", warm)
    assert w.status_code == 200 and w.json() == {}, w.text
    shown = post(srv, "/infill", {**warm, "response_fields": ["generation_settings/samplers"]}).json()
    assert shown == {"generation_settings/samplers": []}  # an empty chain: only the final draw
    full = post(srv, "/infill", llama_vim_fim(n_indent=0, t_max_predict_ms=-1, n_predict=12, ignore_eos=True,
                                              response_fields=["tokens_predicted", "stop_type"]))
    assert full.json() == {"tokens_predicted": 12, "stop_type": "limit"}, full.text


def test_llama_vscode_bodies(srv):
    """llama.vscode's FIM request and its cache warm-up (src/llama-server.ts), field for field: accepted,
    answered with llama-server's fields."""
    chunks = [{"text": "import os\n", "time": 1733000000000, "filename": "/w/a.py"}]
    fim = {"input_prefix": "def f(x):\n", "input_suffix": "\n", "input_extra": chunks, "prompt": "    ",
           "n_predict": 8, "top_k": 40, "top_p": 0.99, "stream": False, "samplers": ["top_k", "top_p", "infill"],
           "cache_prompt": True, "t_max_prompt_ms": 500, "t_max_predict_ms": 2500}
    r = post(srv, "/infill", fim)
    assert r.status_code == 200 and {"content", "tokens_cached", "truncated", "timings"} <= set(r.json()), r.text
    warm = {**fim, "input_prefix": "", "input_suffix": "", "prompt": "", "n_predict": 1,
            "samplers": ["temperature"], "t_max_prompt_ms": 1, "t_max_predict_ms": 1}
    w = post(srv, "/infill", warm)
    assert w.status_code == 200 and w.json()["generation_settings"]["samplers"] == ["temperature"], w.text


def forced(s, **over) -> dict:
    body = {"prompt": PROMPT, "grammar": GRAMMAR, "temperature": 0, "n_predict": 40, **over}
    r = post(s, "/completion", body)
    assert r.status_code == 200, r.text
    return r.json()


def test_n_indent_stops_at_a_less_indented_line_and_cuts_it(srv):
    """The grammar fixes the text; n_indent 3 stops at "  z" (indent 2) keeping its indentation, n_indent 2 at
    "w", so does 1, n_indent 0 never (llama-server's bookkeeping: engine/linestops.py)."""
    full = forced(srv)
    assert full["content"] == FORCED and full["stop_type"] == "eos"
    assert forced(srv, n_indent=0)["content"] == FORCED
    three = forced(srv, n_indent=3)
    assert three["content"] == "x\n    y\n  " and three["stop_type"] == "limit"
    for n in (1, 2):  # "w" (indent 0) is the first line below either
        assert forced(srv, n_indent=n)["content"] == "x\n    y\n  z\n"
    assert forced(srv, n_indent=5)["content"] == "x\n    "  # the indentation of the cut line stays


def test_t_max_predict_ms_stops_at_a_new_line(srv):
    """1 ms: generation ends at a token with a new line once that much has passed since the first token (the
    grammar's output is 80 lines; which line it stops at is not asserted)."""
    lines = "a\n" * 80
    body = {"prompt": PROMPT, "grammar": 'root ::= "' + lines.replace("\n", "\\n") + '"', "temperature": 0,
            "n_predict": 200}
    whole = post(srv, "/completion", body).json()
    assert whole["content"] == lines
    out = post(srv, "/completion", {**body, "t_max_predict_ms": 1}).json()
    assert out["stop_type"] == "limit" and out["content"].endswith("\n") and lines.startswith(out["content"])
    assert out["tokens_predicted"] < whole["tokens_predicted"]
    chat = httpx.post(srv[0].url + "/v1/completions", json={**body, "max_tokens": 200, "t_max_predict_ms": 1,
                                                            "n_predict": None}, timeout=120).json()
    assert chat["choices"][0]["finish_reason"] == "length"


NEUTRAL = [{"typical_p": 1.0}, {"mirostat": 0, "mirostat_tau": 3.0, "mirostat_eta": 0.5},
           {"dry_multiplier": 0.0, "dry_base": 2.0, "dry_allowed_length": 3, "dry_penalty_last_n": 16,
            "dry_sequence_breakers": ["\n"]},
           {"xtc_probability": 0.0, "xtc_threshold": 0.2}, {"xtc_probability": 1.0, "xtc_threshold": 0.6},
           {"n_indent": 0}, {"t_max_predict_ms": -1}, {"t_max_predict_ms": 0}, {"t_max_prompt_ms": 500},
           {"samplers": ["penalties", "dry", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature"]},
           {"samplers": "edkypmxt"}, {"samplers": ["top_k", "top_n_sigma", "typical", "nucleus", "min_p", "temp"]}]


@pytest.mark.parametrize("field", NEUTRAL, ids=lambda f: ",".join(f))
def test_neutral_values_give_the_plain_tokens(srv, field):
    """Each field at its neutral value (and the default order spelled out) samples exactly the tokens of the
    request without it, with llama-server's defaults (temperature 0.8, top_k 40, top_p 0.95, min_p 0.05)."""
    base = {"prompt": PROMPT, "n_predict": 16, "seed": 1234, "ignore_eos": True, "return_tokens": True}
    plain = post(srv, "/completion", base).json()
    got = post(srv, "/completion", {**base, **field})
    assert got.status_code == 200, got.text
    assert got.json()["tokens"] == plain["tokens"]


def test_non_neutral_samplers_act(srv):
    """XTC at probability 1, threshold 0 removes the greedy token; mirostat 1 and 2, DRY, typical_p give text,
    the same twice with a seed; `samplers` without top_k samples otherwise than with it at top_k 1, the same
    for the same seed and not for all seeds."""
    base = {"prompt": PROMPT, "n_predict": 8, "temperature": 0, "ignore_eos": True, "return_tokens": True}
    greedy = post(srv, "/completion", base).json()["tokens"]
    xtc = post(srv, "/completion", {**base, "xtc_probability": 1.0, "xtc_threshold": 0.0}).json()["tokens"]
    assert xtc[0] != greedy[0]
    for extra in ({"mirostat": 1}, {"mirostat": 2, "mirostat_tau": 2.0}, {"dry_multiplier": 2.0},
                  {"typical_p": 0.5}):
        body = {**base, "temperature": 0.8, "seed": 5, **extra}
        a, b = post(srv, "/completion", body).json(), post(srv, "/completion", body).json()
        assert a["tokens_predicted"] == 8 and a["tokens"] == b["tokens"], extra
    k1 = {**base, "temperature": 1.0, "top_k": 1, "seed": 3}
    assert post(srv, "/completion", {**k1, "samplers": ["top_k"]}).json()["tokens"] == greedy
    runs = [post(srv, "/completion", {**k1, "samplers": ["temperature"], "seed": s}).json()["tokens"]
            for s in (0, 0, 1, 2, 3)]
    assert runs[0] == runs[1] and len({tuple(r) for r in runs}) > 1  # a seed fixes the draw; seeds differ


BAD = [("samplers", ["bogus"]), ("samplers", ["adaptive_p"]), ("samplers", "kz"), ("mirostat", 3),
       ("xtc_probability", 2.0), ("typical_p", -0.1), ("dry_sequence_breakers", []), ("n_indent", -1),
       ("t_max_predict_ms", -2), ("dry_allowed_length", -1)]


@pytest.mark.parametrize(("name", "value"), BAD, ids=[f"{n}={v}" for n, v in BAD])
def test_bad_values_are_400s_naming_the_field(srv, name, value):
    r = post(srv, "/completion", {"prompt": PROMPT, "n_predict": 1, name: value})
    assert r.status_code == 400 and name in str(r.json()["error"].get("param")), r.text


def test_text_since_reads_the_tail_as_the_whole_text_would():
    """TextAssembler.since (what the n_indent check reads per token) is text[start:] for every start, with and
    without held-back stop-string text."""
    import random

    from loramux.engine.sampling import TextAssembler
    rng = random.Random(0)
    for trial in range(100):
        t = TextAssembler(["zz"] if trial % 2 else [])
        for _ in range(30):
            t.feed(rng.choice(["a", " ", "\n", "  ", "b\n", "\t", "z"]).encode())
            assert all(t.since(st) == t.text[st:] for st in range(len(t.text) + 1)), t.text
