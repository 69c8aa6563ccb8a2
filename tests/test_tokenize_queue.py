"""/tokenize and /detokenize are counted by the server's queue bound (--parallel + --max-queue), like the
generation routes: past it they get 429 queue_full, and each releases its place when it is done.
Real uvicorn on 127.0.0.1 and real llama.cpp on the tiny model."""

from __future__ import annotations

import time

import httpx

import loramux as lm
from loramux.server import ServerSettings, ServerThread, create_app

LONG = {"model": "tiny", "prompt": "the cat sat", "max_tokens": 4000, "temperature": 0, "ignore_eos": True,
        "stream": True}


def _wait_for(cond, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_tokenizer_routes_take_a_place_in_the_bounded_queue(tiny_model):
    eng = lm.Engine.load(tiny_model, n_ctx=4096, n_parallel=1, n_threads=1, slots=0)
    app = create_app(eng, ServerSettings(parallel=1, n_ctx=4096, max_queue=1), own_engine=True)
    state = app.state.lm
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=60) as h:
        tok = h.post("/tokenize", json={"model": "tiny", "prompt": "the cat"})
        assert tok.status_code == 200, tok.text
        ids = tok.json()["tokens"]
        assert h.post("/detokenize", json={"model": "tiny", "tokens": ids}).status_code == 200
        assert state.in_flight == 0  # both released their place
        streams = [h.stream("POST", "/v1/completions", json=LONG) for _ in range(2)]
        responses = [s.__enter__() for s in streams]
        try:
            assert [r.status_code for r in responses] == [200, 200] and state.in_flight == 2
            for path, body in (("/tokenize", {"model": "tiny", "prompt": "the cat"}),
                               ("/detokenize", {"model": "tiny", "tokens": ids})):
                r = h.post(path, json=body)
                assert r.status_code == 429, (path, r.text)
                assert r.json()["error"]["code"] == "queue_full" and r.headers["retry-after"] == "1"
            assert state.in_flight == 2  # a refused request holds nothing
            assert h.get("/tokenizer_info").status_code == 200  # metadata only: not counted
        finally:
            for s in streams:
                s.__exit__(None, None, None)
        _wait_for(lambda: state.in_flight == 0, "tickets not released")
        assert h.post("/tokenize", json={"model": "tiny", "prompt": "the cat"}).json()["tokens"] == ids
        assert state.in_flight == 0
