"""What every protocol shares, over one response layer (real server, tiny model): the same request gives the
same tokens through chat completions, Anthropic Messages, Responses and Ollama's chat; a per-request adapter
stack (`lora`) works on each; the per-adapter metrics count each; the guard's refusals come in each
protocol's error shape."""

from __future__ import annotations

import json

import httpx
import pytest
from test_server import _metric, adir, serving  # noqa: F401 - adir is a fixture

KEY = "sk-proto"
AUTH = {"Authorization": f"Bearer {KEY}"}
MSG = "the cat sat on the mat"


@pytest.fixture(scope="module")
def srv(tiny_model, adir):  # noqa: F811
    with serving(tiny_model, adir, loras=("a", "b"), parallel=2, n_ctx=1024, api_key=KEY, max_body_bytes=4096) as s:
        yield s


def _texts(url: str, model: str, extra: dict) -> dict[str, str]:
    """The greedy 10-token answer to MSG through each protocol."""
    msgs = [{"role": "user", "content": MSG}]
    out = {}
    r = httpx.post(url + "/v1/chat/completions", headers=AUTH, timeout=120,
                   json={"model": model, "messages": msgs, "max_tokens": 10, "temperature": 0, **extra}).json()
    out["chat"] = r["choices"][0]["message"]["content"]
    r = httpx.post(url + "/v1/messages", headers={"x-api-key": KEY}, timeout=120,
                   json={"model": model, "messages": msgs, "max_tokens": 10, "temperature": 0, **extra}).json()
    out["anthropic"] = r["content"][0]["text"]
    r = httpx.post(url + "/v1/responses", headers=AUTH, timeout=120,
                   json={"model": model, "input": MSG, "max_output_tokens": 10, "temperature": 0, **extra}).json()
    out["responses"] = r["output"][0]["content"][0]["text"]
    r = httpx.post(url + "/api/chat", headers=AUTH, timeout=120,
                   json={"model": model, "messages": msgs, "stream": False, **extra,
                         "options": {"num_predict": 10, "temperature": 0}}).json()
    out["ollama"] = r["message"]["content"]
    return out


def test_every_protocol_gives_the_same_tokens_and_takes_a_lora_stack(srv):
    url = srv[0].url
    base = _texts(url, "tiny", {})
    assert len(set(base.values())) == 1, base
    stack = _texts(url, "tiny", {"lora": [{"name": "a", "scale": 0.7}, {"name": "b", "scale": 0.4}]})
    assert len(set(stack.values())) == 1 and stack["chat"] != base["chat"], stack
    adapter = _texts(url, "a", {})
    assert len(set(adapter.values())) == 1 and adapter["chat"] not in (base["chat"], stack["chat"]), adapter


def test_adapter_metrics_count_every_protocol(srv):
    url = srv[0].url

    def count() -> float:
        text = httpx.get(url + "/metrics", headers=AUTH).text
        return _metric(text, 'loramux_adapter_requests_total{adapter="b"}')
    before = count()
    _texts(url, "b", {})
    assert count() - before == 4


def test_guard_refusals_take_each_protocols_shape(srv):
    url = srv[0].url
    big = {"model": "tiny", "messages": [{"role": "user", "content": "x" * 5000}], "max_tokens": 2}
    r = httpx.post(url + "/v1/messages", json=big, headers={"x-api-key": KEY})
    assert r.status_code == 413 and r.json()["type"] == "error" and r.json()["error"]["type"] == "request_too_large"
    r = httpx.post(url + "/api/chat", json=big, headers=AUTH)
    assert r.status_code == 413 and set(r.json()) == {"error"} and "4096" in r.json()["error"]
    r = httpx.post(url + "/v1/responses", json=big, headers=AUTH)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = httpx.post(url + "/v1/messages", json={}, headers={"x-api-key": "wrong"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = httpx.post(url + "/api/generate", json={})
    assert r.status_code == 401 and isinstance(r.json()["error"], str)
    r = httpx.get(url + "/api/chat", headers=AUTH)  # a wrong method on a protocol's path: its shape too
    assert r.status_code == 405 and isinstance(r.json()["error"], str)
    r = httpx.post(url + "/v1/messages", content=b"x", headers={"x-api-key": KEY, "Content-Type": "text/plain"})
    assert r.status_code == 415 and r.json()["type"] == "error"
    assert httpx.get(url + "/health").status_code == 200


HOSTILE = ["\ud800", "\x00", "{{ raise('x') }}", "<start_of_turn>", "😀" * 50, "", None, 10**30, -1, [], {}, 1e308]


def _bodies() -> list[tuple[str, dict]]:
    """One valid body per new route; every field of each is then replaced by each hostile value."""
    msgs = [{"role": "user", "content": "hi"}]
    return [("/v1/messages", {"model": "a", "max_tokens": 3, "messages": msgs, "system": "s", "stop_sequences": ["x"],
                              "tools": [{"name": "f", "input_schema": {"type": "object"}}],
                              "tool_choice": {"type": "auto"}, "metadata": {"user_id": "u"}}),
            ("/v1/messages/count_tokens", {"model": "a", "messages": msgs}),
            ("/v1/responses", {"model": "a", "input": [{"role": "user", "content": "hi"}], "max_output_tokens": 3,
                               "instructions": "i", "text": {"format": {"type": "text"}},
                               "tools": [{"type": "function", "name": "f"}], "tool_choice": "auto"}),
            ("/api/chat", {"model": "tiny:a", "messages": msgs, "stream": False, "format": "json",
                           "options": {"num_predict": 3, "stop": ["x"], "seed": 1}, "keep_alive": "5m"}),
            ("/api/generate", {"model": "tiny", "prompt": "hi", "system": "s", "stream": False,
                               "options": {"num_predict": 3}}),
            ("/api/show", {"model": "tiny:b"})]


def test_hostile_values_in_every_field_never_5xx(srv):
    url = srv[0].url
    deep = '{"model": "a", "max_tokens": 2, "messages": [{"role": "user", "content": ' + "[" * 1500 + "]" * 1500 + "}]}"
    r = httpx.post(url + "/v1/messages", content=deep, headers={"x-api-key": KEY, "Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["type"] == "error", r.text  # deeper than the JSON parser goes
    with httpx.Client(headers={**AUTH, "x-api-key": KEY, "Content-Type": "application/json"}, timeout=120) as c:
        for path, body in _bodies():
            ok = c.post(url + path, json=body)
            assert ok.status_code == 200, (path, ok.text)
            for key in body:
                for value in HOSTILE:
                    r = c.post(url + path, content=json.dumps({**body, key: value}))  # lone surrogates escaped
                    assert r.status_code < 500, (path, key, value, r.text)
                    if r.status_code >= 400:
                        got = r.json()
                        shape = ("type" in got and "error" in got) if path.startswith("/v1/messages") else \
                            isinstance(got.get("error"), str) if path.startswith("/api/") else "message" in got["error"]
                        assert shape, (path, key, got)
    assert httpx.get(url + "/health").status_code == 200
