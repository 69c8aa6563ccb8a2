"""Factor pushes over HTTP: the next request equals a fresh load, in-flight requests keep their version,
versions are named in every response and can be asked for, bad pushes change nothing."""

from __future__ import annotations

import json
import threading
from contextlib import contextmanager
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from tinymodel import ARCH, random_factors, write_tiny_lora

import loramux as lm
from loramux.client import Client
from loramux.errors import ServerError
from loramux.gguf_io import write_adapter
from loramux.gguf_io.safetensors import dump_safetensors
from loramux.server import ServerSettings, create_app, serve_in_thread
from loramux.server.config import LoraEntry

ADMIN = {"Authorization": "Bearer admin-key"}
PROMPT = "the cat sat on the mat"


@contextmanager
def serving(model: Path, adir: Path, names: tuple[str, ...], **settings: object):
    eng = lm.Engine.load(model, n_ctx=512, n_parallel=1, n_threads=1)
    entries = tuple(LoraEntry(n, str(adir / f"{n}.gguf")) for n in names)
    for e in entries:
        eng.load_lora(e.source, e.name)
    app = create_app(eng, ServerSettings(loras=entries, adapter_dirs=(str(adir),), admin_api_key="admin-key",
                                         **settings), own_engine=True)
    with serve_in_thread(app) as srv:
        yield srv, eng


@pytest.fixture(scope="module")
def adir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("push")
    for i, n in enumerate(("p", "q", "bad"), 1):
        write_tiny_lora(d / f"{n}.gguf", seed=40 + i, rank=2, scale=0.5)
    return d


@pytest.fixture(scope="module")
def server(tiny_model: Path, adir: Path):
    with serving(tiny_model, adir, ("p", "q", "bad"), max_upload_bytes=256 << 10) as s:
        yield s


def tokens(srv, model: str, max_tokens: int = 24) -> tuple[list[int], dict, httpx.Headers]:
    """Greedy completion token ids of `model`, its adapter_versions field and the response headers."""
    oa = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=120)
    raw = oa.completions.with_raw_response.create(model=model, prompt=PROMPT, max_tokens=max_tokens,
                                                  temperature=0, extra_body={"return_token_ids": True,
                                                                             "ignore_eos": True})
    r = raw.parse()
    return r.choices[0].model_extra["token_ids"], r.model_extra["adapter_versions"], raw.headers


def fresh_tokens(srv, adir: Path, name: str, factors, alpha: float, max_tokens: int = 24) -> list[int]:
    """The same request on `factors` loaded from a new GGUF under a new name (a fresh load)."""
    write_adapter(adir / f"{name}.gguf", ARCH, factors, alpha)
    r = httpx.post(srv.url + "/v1/load_lora_adapter", headers=ADMIN,
                   json={"lora_name": name, "lora_path": str(adir / f"{name}.gguf")})
    assert r.status_code == 200, r.text
    return tokens(srv, name, max_tokens)[0]


def test_push_then_next_request_is_a_fresh_load(server, adir):
    srv, eng = server
    before, v_before, _ = tokens(srv, "p")
    new = random_factors(rank=2, seed=7, scale=0.8)
    with Client(srv.url, api_key="admin-key") as c:
        out = c.push("p", new)
        assert out["version"] == v_before["p"] + 1 == c.adapter("p")["version"]
        assert len(out["sha256"]) == 16 and out["bytes"] > 0
    after, v_after, headers = tokens(srv, "p")
    assert v_after == {"p": out["version"]}
    assert headers["x-loramux-adapter-versions"] == f"p={out['version']}"
    assert after != before  # the push changed what is served
    assert after == fresh_tokens(srv, adir, "p_fresh", new, eng.adapter("p").alpha)


def test_inflight_request_finishes_on_its_version(server, adir):
    srv, eng = server
    n = 400
    old, v_old, _ = tokens(srv, "q", n)
    new = random_factors(rank=2, seed=8, scale=0.8)
    body = {"model": "q", "prompt": PROMPT, "max_tokens": n, "temperature": 0, "stream": True,
            "ignore_eos": True, "return_token_ids": True}
    pushed: dict = {}
    with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=120) as r:
        assert r.headers["x-loramux-adapter-versions"] == f"q={v_old['q']}"
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert '"text"' in first
        # the push is sent while the stream decodes; it lands only once the stream is done
        t = threading.Thread(target=lambda: pushed.update(Client(srv.url, api_key="admin-key").push("q", new)))
        t.start()
        chunks = [line for line in lines if line.startswith("data: {")]
        t.join(60)
    last = httpx.Response(200, content=chunks[-1][6:]).json()
    assert last["choices"][0]["token_ids"] == old
    assert last["adapter_versions"] == v_old
    assert pushed["version"] == v_old["q"] + 1
    after, v_after, _ = tokens(srv, "q", n)
    assert v_after == {"q": pushed["version"]}
    assert after == fresh_tokens(srv, adir, "q_fresh", new, eng.adapter("q").alpha, n)


def test_a_request_may_ask_for_a_version(server):
    srv, _ = server
    with Client(srv.url, api_key="admin-key") as c:
        v = c.push("p", random_factors(rank=2, seed=9, scale=0.5))["version"]
    toks, versions, _ = tokens(srv, f"p@{v}")
    assert versions == {"p": v} and toks == tokens(srv, "p")[0]
    r = httpx.post(srv.url + "/v1/chat/completions", json={"model": f"p@{v - 1}", "max_tokens": 2,
                                                           "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 410, r.text
    err = r.json()["error"]
    assert err["code"] == "adapter_version_gone" and err["param"] == "model" and f"p@{v}" in err["message"]


def test_peft_names_push_like_gguf_names(server):
    srv, eng = server
    a = np.full((2, 32), 0.01, np.float32)
    b = np.linspace(-0.1, 0.1, 2 * 16, dtype=np.float32).reshape(16, 2)
    shape_a, shape_b = (f := eng.adapter("p").factor_tensors()["blk.1.attn_v.weight"]).a_shape, f.b_shape
    a, b = np.resize(a, shape_a), np.resize(b, shape_b)
    peft = {"base_model.model.model.layers.1.self_attn.v_proj.lora_A.weight": a,
            "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight": b}
    r = httpx.put(srv.url + "/v1/adapters/p/factors", headers={**ADMIN, "Content-Type": "application/octet-stream"},
                  content=dump_safetensors(peft))
    assert r.status_code == 200, r.text
    ra, rb = eng.adapter("p").get_factors("blk.1.attn_v.weight")
    assert np.array_equal(ra, a) and np.array_equal(rb, b)


def _bad_bodies(eng) -> dict[str, tuple[bytes, int, str]]:
    f = eng.adapter("bad").factor_tensors()
    name = next(iter(f))
    ga, gb = np.zeros(f[name].a_shape, np.float32), np.zeros(f[name].b_shape, np.float32)
    nan = ga.copy()
    nan[0, 0] = np.nan
    st = dump_safetensors
    return {
        "wrong shape": (st({name + ".lora_a": np.zeros((3, ga.shape[1]), np.float32), name + ".lora_b": gb}),
                        400, "invalid_factors"),
        "NaN": (st({name + ".lora_a": nan, name + ".lora_b": gb}), 400, "invalid_factors"),
        "unknown tensor": (st({"blk.0.attn_nope.weight.lora_a": ga, "blk.0.attn_nope.weight.lora_b": gb}),
                           400, "invalid_factors"),
        "not a factor name": (st({name: ga}), 400, "invalid_factors"),
        "half a pair": (st({name + ".lora_a": ga}), 400, "invalid_factors"),
        "overflowing delta": (st({name + ".lora_a": ga + 1e30, name + ".lora_b": gb + 1e30}), 400,
                              "invalid_factors"),
        "not safetensors": (b"\xff" * 64, 400, "invalid_parameter"),
        "too large": (b"\0" * (300 << 10), 413, "request_too_large"),
    }


def test_bad_pushes_are_refused_and_change_nothing(server):
    srv, eng = server
    served, versions, _ = tokens(srv, "bad")
    for why, (body, status, code) in _bad_bodies(eng).items():
        r = httpx.put(srv.url + "/v1/adapters/bad/factors", content=body,
                      headers={**ADMIN, "Content-Type": "application/octet-stream"})
        assert r.status_code == status, (why, r.text)
        assert r.json()["error"]["code"] == code, (why, r.text)
        now, now_versions, _ = tokens(srv, "bad")
        assert (now, now_versions) == (served, versions), why
    with Client(srv.url, api_key="admin-key") as c, pytest.raises(ServerError) as e:
        c.push("bad", {"blk.0.attn_q.weight": (np.zeros((2, 2)), np.zeros((2, 2)))})
    assert e.value.status == 400 and "expected A" in str(e.value)


def test_pushes_are_admin_only(server):
    srv, eng = server
    body = dump_safetensors({})
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.put(srv.url + "/v1/adapters/p/factors", content=body, headers=headers)
        assert r.status_code in (401, 403), r.text
        r = httpx.get(srv.url + "/v1/adapters/p", headers=headers)
        assert r.status_code in (401, 403), r.text
    r = httpx.put(srv.url + "/v1/adapters/nope/factors", content=body, headers=ADMIN)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_every_protocol_names_the_versions(server):
    srv, eng = server
    v = eng.adapter("p").version
    calls = [("/v1/messages", {"model": "p", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}),
             ("/api/generate", {"model": "tiny:p", "prompt": "hi", "stream": False, "options": {"num_predict": 4}}),
             ("/v1/responses", {"model": "p", "input": "hi", "max_output_tokens": 4}),
             ("/v1/chat/completions", {"model": "p", "max_tokens": 4, "stream": True,
                                       "messages": [{"role": "user", "content": "hi"}]})]
    for path, body in calls:
        r = httpx.post(srv.url + path, json=body, timeout=120)
        assert r.status_code == 200, (path, r.text)
        assert r.headers["x-loramux-adapter-versions"] == f"p={v}", path
        if path != "/v1/chat/completions":  # (streamed: the field is in the last chunk)
            assert r.json()["adapter_versions"] == {"p": v}, path
    r = httpx.post(srv.url + "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
    assert r.headers["x-loramux-adapter-versions"] == "" and r.json()["adapter_versions"] == {}


def _sse_data(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


def test_streams_and_scored_bodies_name_the_versions(server):
    """The paths of their own: Anthropic's stream (message_delta), chat/completions with logprobs or n > 1
    (body and stream: each choice's last chunk) and a fan-out's choices carry the field and the header."""
    srv, eng = server
    v = eng.adapter("p").version
    chat = {"model": "p", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(srv.url + "/v1/messages", json={**chat, "stream": True}, timeout=120)
    assert r.status_code == 200 and r.headers["x-loramux-adapter-versions"] == f"p={v}", r.text
    deltas = [e for e in _sse_data(r.text) if e["type"] == "message_delta"]
    assert [e["adapter_versions"] for e in deltas] == [{"p": v}], r.text
    for extra in ({"logprobs": True, "top_logprobs": 2}, {"n": 2, "temperature": 1.0, "seed": 3}):
        r = httpx.post(srv.url + "/v1/chat/completions", json={**chat, **extra}, timeout=120)
        assert r.status_code == 200 and r.headers["x-loramux-adapter-versions"] == f"p={v}", r.text
        assert r.json()["adapter_versions"] == {"p": v}, (extra, r.text)
        r = httpx.post(srv.url + "/v1/chat/completions", json={**chat, **extra, "stream": True}, timeout=120)
        assert r.status_code == 200 and r.headers["x-loramux-adapter-versions"] == f"p={v}", r.text
        ends = [e for e in _sse_data(r.text) if e["choices"] and e["choices"][0]["finish_reason"]]
        assert len(ends) == extra.get("n", 1) and all(e["adapter_versions"] == {"p": v} for e in ends), r.text
    r = httpx.post(srv.url + "/v1/completions", timeout=120,
                   json={"model": "p", "prompt": "hi", "max_tokens": 2, "logprobs": 1, "echo": True})
    assert r.status_code == 200 and r.json()["adapter_versions"] == {"p": v}, r.text
    r = httpx.post(srv.url + "/v1/completions", timeout=120, json={"model": "tiny", "prompt": "hi", "max_tokens": 2,
                                                                   "adapter_sets": [{"lora": [{"name": "p", "scale": 1.0}]},
                                                                                    {"lora": []}]})
    assert r.status_code == 200, r.text
    assert [c["adapter_versions"] for c in r.json()["choices"]] == [{"p": v}, {}], r.text
    assert r.json()["adapter_versions"] == {"p": v}, r.text


def test_requests_submitted_while_a_push_waits_run_on_the_new_version(tiny_model, tmp_path):
    """Engine level: a push waits for the stream on the old version; a request submitted meanwhile is held
    and runs on the pushed factors (its completion names the new version and has a fresh load's tokens)."""
    write_tiny_lora(tmp_path / "w.gguf", seed=5, rank=2, scale=0.5)
    new = random_factors(rank=2, seed=6, scale=0.8)
    write_adapter(tmp_path / "fresh.gguf", ARCH, new, 2.0)
    with lm.Engine.load(tiny_model, n_ctx=512, n_parallel=2, n_threads=1, loras=[str(tmp_path / "w.gguf")]) as eng:
        kw = {"max_tokens": 200, "temperature": 0, "ignore_eos": True}
        old = eng.generate(PROMPT, loras={"w": 1.0}, **kw)
        running = eng.stream(PROMPT, loras={"w": 1.0}, **kw)
        it = iter(running)
        next(it)
        pushed: list[int] = []
        t = threading.Thread(target=lambda: pushed.append(eng.push_factors("w", new)))
        t.start()
        while not eng.pushes.pending and t.is_alive():
            pass
        assert eng.pushes.pending  # the push waits for the running stream
        behind = eng.stream(PROMPT, loras={"w": 1.0}, **kw)  # submitted while it waits
        for _ in it:
            pass
        t.join(60)
        after = behind.consume()
        fresh = eng.load_lora(tmp_path / "fresh.gguf", "fresh")
        ref = eng.generate(PROMPT, loras={fresh.name: 1.0}, **kw)
    assert running.completion.tokens == old.tokens and running.completion.versions == {"w": 0}
    assert pushed == [1] and after.versions == {"w": 1}
    assert after.tokens == ref.tokens != old.tokens


def test_prefix_reuse_is_keyed_by_version(tiny_model, tmp_path):
    """The slot's prompt KV is reused for the same prompt on the same version, never across a push: the
    resent prompt decodes again (no tokens reused) and gives exactly a fresh load's tokens of the new factors."""
    write_tiny_lora(tmp_path / "k.gguf", seed=11, rank=2, scale=0.8)
    new = random_factors(rank=2, seed=12, scale=0.8)
    write_adapter(tmp_path / "fresh.gguf", ARCH, new, 2.0)
    prompt = " ".join([PROMPT, "and the dog ran far away from the old house by the river"] * 2)
    kw = {"max_tokens": 24, "temperature": 0, "ignore_eos": True}
    with lm.Engine.load(tiny_model, n_ctx=512, n_parallel=1, n_threads=1, loras=[str(tmp_path / "k.gguf")]) as eng:

        def run() -> tuple[list[int], int]:
            before = eng.stats().prompt_tokens_reused
            c = eng.generate(prompt, loras={"k": 1.0}, **kw)
            return c.tokens, eng.stats().prompt_tokens_reused - before
        old, _ = run()
        again, reused_same = run()  # same version: the prefix comes from the slot's cache
        assert eng.push_factors("k", new) == 1
        pushed, reused_pushed = run()  # a new version: nothing of the old KV may be used
        pushed_again, reused_new = run()
        n_prompt = len(eng.tokenize(prompt))
        fresh = eng.load_lora(tmp_path / "fresh.gguf", "fresh")
        ref = eng.generate(prompt, loras={fresh.name: 1.0}, **kw)
    assert reused_same == n_prompt - 1 and again == old  # the reuse this guards against does happen
    assert pushed == ref.tokens != old  # (first: a reused old-version prefix changes the tokens)
    assert reused_pushed == 0
    assert reused_new == n_prompt - 1 and pushed_again == ref.tokens
