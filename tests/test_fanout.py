"""Fan-out (`adapter_sets`): one request over several adapter sets, one result per set, decoded together
through the slot bank, on a real uvicorn and the tiny model (F32 weights)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from test_server import adir, client, errbody, serving  # noqa: F401 - adir is a fixture

from loramux.gguf_io import read_adapter_factors, validate_adapter, write_adapter

SETS = [{"name": "a", "lora": [{"name": "a", "scale": 1.0}]},
        {"name": "b+s1", "lora": [{"name": "b", "scale": 0.7}, {"name": "s1", "scale": 1.0}]},
        {"lora": []},  # the base alone
        {"lora": [{"name": "s2", "scale": 1.0}]}]
STACKS = [{"a": 1.0}, {"b": 0.7, "s1": 1.0}, {}, {"s2": 1.0}]
LABELS = ["a", "b+s1", "tiny", "s2:1"]
DET = os.environ.get("LORAMUX_DET_PYTHON")  # llama.cpp without llamafile's sgemm (scripts/det-venv.sh)
TOL_FLOORS = 32  # as tests/test_bank.py: a batched token within this many noise floors of the native argmax


def _post(srv: object, path: str, body: dict, **kw: object) -> httpx.Response:
    return httpx.post(srv.url + path, json=body, timeout=120, **kw)


def _solo(srv: object, prompt: str, stack: dict[str, float], max_tokens: int) -> list[int]:
    lora = [{"name": n, "scale": s} for n, s in stack.items()]
    r = _post(srv, "/v1/completions", {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                        "ignore_eos": True, "lora": lora, "return_token_ids": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def _fan(srv: object, prompt: str, max_tokens: int, **extra: object) -> dict:
    r = _post(srv, "/v1/completions", {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                        "ignore_eos": True, "adapter_sets": SETS, "return_token_ids": True,
                                        **extra})
    assert r.status_code == 200, r.text
    return r.json()


def _sse(r: httpx.Response) -> list[dict]:
    out = []
    for line in r.text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[6:]))
    return out


def test_fanout_one_at_a_time_equals_each_set_alone(tiny_model, adir):  # noqa: F811
    """parallel 1: the sets' sequences run one after another, each with the batch composition of a request
    alone, so every set's tokens are exactly those of the same request made alone; streamed chunks name their
    set and carry the same text."""
    with serving(tiny_model, adir, loras=("a", "b", "s1", "s2"), parallel=1) as (srv, _eng, _):
        prompt = "the cat sat"
        body = _fan(srv, prompt, 10)
        assert [c["adapter_set"] for c in body["choices"]] == LABELS
        assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
        solo = [_solo(srv, prompt, s, 10) for s in STACKS]
        assert [c["token_ids"] for c in body["choices"]] == solo
        assert len({tuple(t) for t in solo}) == len(solo)  # the sets really differ: the labels are not moot
        assert body["usage"]["completion_tokens"] == 40

        r = _post(srv, "/v1/completions", {"prompt": prompt, "max_tokens": 10, "temperature": 0,
                                            "ignore_eos": True, "adapter_sets": SETS, "stream": True})
        chunks = _sse(r)
        texts: dict[str, str] = {}
        for ch in chunks:
            (c,) = ch["choices"]
            assert LABELS[c["index"]] == c["adapter_set"]
            texts[c["adapter_set"]] = texts.get(c["adapter_set"], "") + c["text"]
        assert texts == {c["adapter_set"]: c["text"] for c in body["choices"]}

        chat = {"messages": [{"role": "user", "content": "hello world"}], "max_tokens": 8, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True}
        r = _post(srv, "/v1/chat/completions", {**chat, "adapter_sets": SETS})
        assert r.status_code == 200, r.text
        alone = [_post(srv, "/v1/chat/completions", {**chat, "lora": s["lora"]}).json()["choices"][0]
                 for s in SETS]
        assert [c["token_ids"] for c in r.json()["choices"]] == [c["token_ids"] for c in alone]
        assert [c["prompt_token_ids"] for c in r.json()["choices"]] == [c["prompt_token_ids"] for c in alone]


def _bumped(path: Path, tmp: Path) -> Path:
    """The same adapter with every B scaled by (1 + 1e-7): the noise-floor twin."""
    info = validate_adapter(path)
    f = {t: (a, (b.astype(np.float64) * (1 + 1e-7)).astype(np.float32))
         for t, (a, b) in read_adapter_factors(path).items()}
    return write_adapter(tmp / f"{path.stem}~.gguf", "llama", f, info.alpha)


def test_fanout_through_the_bank_shares_decodes_and_keeps_each_set(tiny_model, adir, tmp_path):  # noqa: F811
    """parallel 4 with a 4-slot bank: the sets' sequences share decode steps (fewer steps than tokens), and
    each set's tokens are llama.cpp's native greedy choices for that set alone (teacher-forced, one sequence)
    up to the noise floor of a 1e-7 change of its adapters, measured here: the bank's documented numerics."""
    for n in ("a", "b", "s1", "s2"):
        _bumped(adir / f"{n}.gguf", tmp_path)
    with serving(tiny_model, adir, loras=("a", "b", "s1", "s2"), parallel=4, slots=4) as (srv, eng, _):
        for n in ("a", "b", "s1", "s2"):
            eng.load_lora(str(tmp_path / f"{n}~.gguf"), f"{n}~")
        prompt = "a big red dog"
        steps = eng.stats().decode_steps
        body = _fan(srv, prompt, 12)
        taken = eng.stats().decode_steps - steps
        assert taken < 4 * 12  # decoded together, not one set after another
        ptoks = eng.tokenize(prompt)
        for choice, stack in zip(body["choices"], STACKS):
            comp = choice["token_ids"]
            seq = ptoks + comp[:-1]
            want = eng.logits(seq, loras=stack)[len(ptoks) - 1:]
            if stack:
                twin = eng.logits(seq, loras={f"{n}~": s for n, s in stack.items()})[len(ptoks) - 1:]
                floor = float(np.abs(twin - want).max())
                assert floor > 0
            else:
                floor = 0.0  # the base: no adapter in the bank can move its logits (masked rows)
            picked = want[np.arange(len(comp)), comp]
            worst = float((want.max(axis=1) - picked).max())
            assert worst <= TOL_FLOORS * max(floor, 1e-6), (choice["adapter_set"], worst, floor)


def test_fanout_chat_stream_names_sets_and_logprobs(tiny_model, adir):  # noqa: F811
    """Chat completions: every streamed chunk names its set; logprobs come per set; the role chunk opens
    each choice; the final usage counts every set."""
    with serving(tiny_model, adir, loras=("a", "b", "s1", "s2"), parallel=2, slots=2) as (srv, _eng, _):
        r = _post(srv, "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "hello world"}], "max_tokens": 6, "temperature": 0,
            "ignore_eos": True, "adapter_sets": SETS[:3], "stream": True, "logprobs": True,
            "stream_options": {"include_usage": True}})
        assert r.status_code == 200, r.text
        chunks = _sse(r)
        roles, tokens = set(), {}
        for ch in chunks[:-1]:
            (c,) = ch["choices"]
            assert c["adapter_set"] == LABELS[c["index"]]
            if c["delta"].get("role"):
                roles.add(c["index"])
            if c["logprobs"]:
                tokens[c["index"]] = tokens.get(c["index"], 0) + len(c["logprobs"]["content"])
        assert roles == {0, 1, 2}
        assert set(tokens) == {0, 1, 2} and all(1 <= v <= 6 for v in tokens.values()), tokens  # EOG: no entry
        assert chunks[-1]["usage"]["completion_tokens"] == 18

        # the official client reads a fan-out as choices with an extra field, streamed or not
        c = client(srv)
        msgs = [{"role": "user", "content": "hello world"}]
        full = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=4, temperature=0,
                                         extra_body={"adapter_sets": SETS[:3]})
        assert [ch.model_extra["adapter_set"] for ch in full.choices] == LABELS[:3]
        got: dict[str, str] = {}
        for chunk in c.chat.completions.create(model="tiny", messages=msgs, max_tokens=4, temperature=0, stream=True,
                                               extra_body={"adapter_sets": SETS[:3]}):
            for ch in chunk.choices:
                got[ch.model_extra["adapter_set"]] = got.get(ch.model_extra["adapter_set"], "") + (ch.delta.content or "")
        assert got == {ch.model_extra["adapter_set"]: ch.message.content for ch in full.choices}


def test_fanout_refusals_name_the_field(tiny_model, adir):  # noqa: F811
    with serving(tiny_model, adir, loras=("a",), parallel=1) as (srv, _eng, state):
        base = {"prompt": "hi", "max_tokens": 2}
        cases = [({"adapter_sets": SETS[:1], "model": "a"}, 400, "model"),
                 ({"adapter_sets": SETS[:1], "lora": []}, 400, "lora"),
                 ({"adapter_sets": [{"lora": []}] * 17}, 400, "adapter_sets"),
                 ({"adapter_sets": []}, 400, "adapter_sets"),
                 ({"adapter_sets": [{"lora": []}, {"name": "tiny", "lora": []}]}, 400, "adapter_sets[1].name"),
                 ({"adapter_sets": [{"lora": []}, {"lora": [{"name": "nope"}]}]}, 404, "adapter_sets[1].lora[0]"),
                 ({"adapter_sets": [{"lora": [{"name": "a", "scale": 1e9}]}]}, 400, "adapter_sets[0].lora[0].scale"),
                 ({"adapter_sets": [{"lora": []}] * 9, "n": 15}, 400, "adapter_sets"),
                 ({"adapter_sets": [{"lora": []}], "prompt": ["x", "y"]}, 400, "prompt"),
                 ({"adapter_sets": [{"lora": [], "extra": 1}]}, 400, "adapter_sets.0.extra")]
        for extra, status, param in cases:
            r = _post(srv, "/v1/completions", {**base, **extra})
            assert r.status_code == status, (extra, r.text)
            assert errbody(r)["param"] == param, (extra, r.text)
        # a protocol without room for several results refuses the field by name
        r = _post(srv, "/v1/messages", {"model": "tiny", "max_tokens": 2, "adapter_sets": SETS[:1],
                                         "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 400 and "adapter_sets" in r.text, r.text
        r = _post(srv, "/api/generate", {"model": "tiny", "prompt": "hi", "adapter_sets": SETS[:1]})
        assert r.status_code == 400 and "adapter_sets" in r.text, r.text
        assert state.in_flight == 0  # every refusal released its place in the queue
        assert _post(srv, "/v1/completions", {**base, "adapter_sets": [{"lora": []}]}).status_code == 200


@pytest.mark.parametrize("n", [2])
def test_fanout_with_n_is_set_major(tiny_model, adir, n):  # noqa: F811
    with serving(tiny_model, adir, loras=("a",), parallel=2) as (srv, _eng, _):
        r = _post(srv, "/v1/completions", {"prompt": "the dog", "max_tokens": 3, "n": n, "seed": 5,
                                            "adapter_sets": [{"lora": []}, {"lora": [{"name": "a"}]}]})
        assert r.status_code == 200, r.text
        assert [c["adapter_set"] for c in r.json()["choices"]] == ["tiny"] * n + ["a:1"] * n


@pytest.mark.skipif(not DET, reason="needs the LLAMAFILE=OFF build for deterministic mode with adapters "
                                    "(set LORAMUX_DET_PYTHON; .ci/run builds one)")
def test_fanout_in_deterministic_mode_equals_each_set_alone(tiny_model, adir):  # noqa: F811
    """`loramux serve --deterministic` with 4 sequences and a 4-slot bank: the sets decoded together give
    exactly the tokens of each request made alone."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src")}
    cmd = [DET, "-m", "loramux", "serve", str(tiny_model), "--deterministic", "--parallel", "4", "--slots", "4",
           "--n-ctx", "512", "--threads", "1", "--port", str(port),
           *(x for n in ("a", "b", "s1", "s2") for x in ("--lora", f"{n}={adir / (n + '.gguf')}"))]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    srv = type("Srv", (), {"url": f"http://127.0.0.1:{port}"})()
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "the server did not start"
            try:
                if httpx.get(srv.url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        for prompt in ("the cat sat", "she ran to the mat"):
            body = _fan(srv, prompt, 12)
            assert [c["token_ids"] for c in body["choices"]] == [_solo(srv, prompt, s, 12) for s in STACKS]
    finally:
        proc.terminate()
        proc.wait(timeout=60)
