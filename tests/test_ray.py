"""loramux.ray on a real local Ray cluster: two replicas, each an Engine, behind one OpenAI endpoint.

Ray's model multiplexing sends a request for adapter X to the replica that already holds X; the
response header names the replica that answered. Killing that replica is survived: the next requests
for X are answered (by the other replica, or the one Serve's controller starts in its place), with the
same greedy text. The ingress checks the API key and the body size itself, so a request without the key
or with an oversized body never reaches a replica (and never makes one load an adapter). Ray runs with 2
CPUs and a small object store and is shut down at the end.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path

import httpx
import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")

from loramux.ray import REPLICA_HEADER, build_app, parse_catalog  # noqa: E402

pytestmark = pytest.mark.slow
APP = "loramux"
KEY = "ray-key"
MAX_BODY = 1 << 20  # ServerSettings' default max_body_bytes, the same as `loramux serve --max-body-bytes`


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster(tiny_dir: Path):
    ray.init(num_cpus=2, object_store_memory=80 * 1024 * 1024, include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    try:
        port = _free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        app = build_app({"model": str(tiny_dir / "tiny.gguf"),
                         "adapters": {"a": str(tiny_dir / "a.gguf"), "b": str(tiny_dir / "b.gguf")},
                         "num_replicas": 2, "replica_cpus": 0.5,
                         "settings": {"parallel": 2, "n_ctx": 256, "slots": 2, "slot_rank": 4, "api_key": KEY}})
        serve.run(app, name=APP, route_prefix="/")
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0, timeout=60)
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


def _ask(client, model: str) -> tuple[str, str]:
    raw = client.completions.with_raw_response.create(model=model, prompt="the cat", max_tokens=6, temperature=0)
    return raw.parse().choices[0].text, raw.headers[REPLICA_HEADER]


def _settled(client, model: str) -> tuple[str, str]:
    """The first request loads the adapter on some replica; give Serve a moment to learn which."""
    first = _ask(client, model)
    time.sleep(3)
    return first


def test_the_ingress_refuses_before_any_replica_sees_the_request(cluster):
    """No key, a wrong key, an oversized body (declared, or chunked without a length): the ingress
    answers itself (no x-loramux-replica header: no replica was called, so none loaded an adapter)."""
    url = str(cluster.base_url).rstrip("/")
    ask = {"model": "b", "prompt": "the cat", "max_tokens": 2}
    with httpx.Client(timeout=60) as h:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Bearer " + KEY + "x"}):
            r = h.post(url + "/completions", json=ask, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
            assert REPLICA_HEADER not in r.headers, r.headers
        auth = {"Authorization": "Bearer " + KEY, "Content-Type": "application/json"}
        big = b'{"model": "b", "prompt": "' + b"x" * MAX_BODY + b'"}'
        chunked = (big[i:i + 65536] for i in range(0, len(big), 65536))  # no content-length
        for content in (big, chunked):
            r = h.post(url + "/completions", content=content, headers=auth)
            assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text[:300]
            assert REPLICA_HEADER not in r.headers, r.headers
        r = h.post(url + "/completions", json=ask, headers=auth)  # the key passes
        assert r.status_code == 200 and r.headers[REPLICA_HEADER], r.text


def test_requests_for_an_adapter_stick_to_the_replica_that_holds_it(cluster):
    text_a, home_a = _settled(cluster, "a")
    text_b, home_b = _settled(cluster, "b")
    for _ in range(5):
        assert _ask(cluster, "a") == (text_a, home_a)
        assert _ask(cluster, "b") == (text_b, home_b)
    assert text_a != text_b  # the adapters really change the output
    base = {_ask(cluster, "tiny")[0] for _ in range(3)}  # the base model: any replica, one answer
    assert len(base) == 1 and base != {text_a}


def test_losing_the_replica_that_holds_an_adapter_is_survived(cluster):
    text, home = _settled(cluster, "a")
    name = next(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                if a["name"].startswith("SERVE_REPLICA::") and a["name"].endswith("#" + home))
    ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
    deadline, answers, errors = time.monotonic() + 120, [], []
    while time.monotonic() < deadline and len(answers) < 3:
        try:
            answers.append(_ask(cluster, "a"))
        except (openai.APIError, openai.APIConnectionError) as e:  # in flight to the dead one: retry
            errors.append(repr(e))
            answers.clear()
            time.sleep(1)
    assert len(answers) == 3, f"no recovery within 120 s: {errors[-3:]}"
    assert all(t == text for t, _ in answers), answers
    assert all(r != home for _, r in answers), (home, answers)


def test_catalog_parsing():
    assert parse_catalog("a=/x/a.gguf, b=/y/b.gguf") == {"a": "/x/a.gguf", "b": "/y/b.gguf"}
    from loramux.errors import ParameterError

    with pytest.raises(ParameterError, match="NAME=PATH"):
        parse_catalog("a")
    with pytest.raises(ParameterError, match="not a loramux.ray argument"):
        build_app({"modle": "x"})
