"""Remote adapter sources through a live server (uvicorn on 127.0.0.1, real llama.cpp on the tiny model) that
fetches from real HTTP servers on 127.0.0.x: the private-network guard and size cap of remote loads, hf://
revisions that would walk the file system, downloads outside the pool lock (one per source) and cancelled
with their client, and sources shown without credentials or directories.

No traffic leaves 127.0.0.0/8: names that resolve elsewhere are made up (getaddrinfo is answered by the test),
and the `no_outside` fixture refuses, and records, any connection to an address outside loopback.
"""

from __future__ import annotations

import hashlib
import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from http_fixture import Server
from tinymodel import write_tiny_lora

import loramux as lm
from loramux.server import LoraEntry, ServerSettings, create_app, serve_in_thread

ADMIN = "admin-key-remote-7b1"
AUTH = {"Authorization": f"Bearer {ADMIN}"}
PASSWORD, SIGNATURE = "pw-s3cr3t-91", "sig-s3cr3t-42"


@pytest.fixture(autouse=True)
def _isolated_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy",
                "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("LORAMUX_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")


@pytest.fixture(scope="module")
def adapter_bytes(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    path = tmp_path_factory.mktemp("remote") / "r.gguf"
    write_tiny_lora(path, seed=41, rank=4, scale=0.5)
    return path.read_bytes()


@pytest.fixture
def files() -> Iterator[Server]:
    srv = Server()
    yield srv
    srv.stop()


@pytest.fixture
def no_outside(monkeypatch: pytest.MonkeyPatch) -> list:
    """Refuse (and record) every TCP connection to an address outside 127.0.0.0/8."""
    real, attempts = socket.create_connection, []

    def create_connection(address, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003
        if not str(address[0]).startswith("127."):
            attempts.append(address)
            raise AssertionError(f"a connection to {address} was attempted")
        return real(address, *args, **kwargs)

    monkeypatch.setattr(socket, "create_connection", create_connection)
    return attempts


@contextmanager
def serving(model: Path, *, loras: tuple[tuple[str, str], ...] = (), **settings: object) -> Iterator[tuple]:
    """A server with remote loads allowed and an admin key; `loras` (name, source) are loaded at start."""
    eng = lm.Engine.load(model, n_ctx=128, n_parallel=1, n_threads=1)
    try:
        for name, source in loras:
            eng.load_lora(source, name)
        cfg = ServerSettings(loras=tuple(LoraEntry(n, s) for n, s in loras), admin_api_key=ADMIN,
                             allow_remote_adapters=True, **settings)
        app = create_app(eng, cfg, own_engine=True)
    except BaseException:
        eng.close()
        raise
    with serve_in_thread(app) as srv:
        yield srv, eng, app.state.lm


def load(srv: object, name: str, source: str, timeout: float = 120) -> httpx.Response:
    return httpx.post(srv.url + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": source},
                      headers=AUTH, timeout=timeout)


def error(r: httpx.Response) -> dict:
    return r.json()["error"]


def wait_for(condition, what: str, timeout: float = 60.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


# ------------------------------------------------------------------------------ where remote loads may go
def test_private_networks_refused_by_default(tiny_model: Path, files: Server, adapter_bytes: bytes,
                                             no_outside: list, monkeypatch: pytest.MonkeyPatch) -> None:
    files.add("/r.gguf", adapter_bytes)
    real = socket.getaddrinfo
    monkeypatch.setattr(socket, "getaddrinfo", lambda host, port, *a, **k: (
        [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("169.254.169.254", port))] if host == "metadata.example.test"
        else real(host, port, *a, **k)))
    with serving(tiny_model) as (srv, eng, _):
        for source in (files.url("/r.gguf"), "http://metadata.example.test/latest/r.gguf",
                       "http://10.0.0.1/r.gguf", "http://[::1]:9/r.gguf"):
            r = load(srv, "r", source)
            assert r.status_code == 403, r.text
            assert error(r)["code"] == "download_refused" and "--allow-private-networks" in error(r)["message"]
        assert files.requests == [] and no_outside == [] and "r" not in eng.adapters
    with serving(tiny_model, allow_private_networks=True) as (srv, eng, _):
        assert load(srv, "r", files.url("/r.gguf")).status_code == 200
        assert "r" in eng.adapters and len(files.for_path("/r.gguf")) == 1


def test_max_adapter_bytes(tiny_model: Path, files: Server, adapter_bytes: bytes, tmp_path: Path) -> None:
    files.add("/r.gguf", adapter_bytes)
    size = len(adapter_bytes)
    with serving(tiny_model, allow_private_networks=True, max_adapter_bytes=size - 1) as (srv, eng, _):
        r = load(srv, "r", files.url("/r.gguf"))
        assert r.status_code == 403 and error(r)["code"] == "download_refused", r.text
        assert f"max_bytes={size - 1}" in error(r)["message"] and "r" not in eng.adapters
        assert not any(f.is_file() for f in (tmp_path / "cache").rglob("*.gguf*") if f.suffix != ".lock")
    with serving(tiny_model, allow_private_networks=True, max_adapter_bytes=size) as (srv, eng, _):
        assert load(srv, "r", files.url("/r.gguf")).status_code == 200


def test_hf_revision_walk_through_the_server(tiny_model: Path, files: Server, adapter_bytes: bytes,
                                             tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{files.port}")
    etag = '"' + hashlib.sha256(adapter_bytes).hexdigest() + '"'
    files.add("/owner/repo/resolve/main/r.gguf", adapter_bytes, etag=etag, headers={"X-Repo-Commit": "c" * 40})
    secret = "/TOPSECRET-walk-5e0"
    (tmp_path / "secret.txt").write_text(secret)
    with serving(tiny_model) as (srv, eng, _):
        assert load(srv, "ok", "hf://owner/repo/r.gguf").status_code == 200  # the repo's cache folder exists
        before = len(files.requests)
        for revision in ("../../../../secret.txt", "/etc/passwd", "refs/../../../../secret.txt"):
            r = load(srv, "walk", f"hf://owner/repo/r.gguf@{revision}")
            assert r.status_code == 400 and error(r)["code"] == "invalid_source", r.text
            assert "TOPSECRET" not in r.text and "revision" in error(r)["message"]
        r = load(srv, "bad", "hf://own--er/repo/r.gguf")
        assert r.status_code == 400 and "repo id" in error(r)["message"]
        assert len(files.requests) == before and "walk" not in eng.adapters


# ------------------------------------------------------------------------------ downloads and the pool lock
def test_download_does_not_hold_the_pool_lock(tiny_model: Path, files: Server, adapter_bytes: bytes,
                                              tmp_path: Path) -> None:
    # The remote body is held back until the local load and unload are done: they must not wait for it.
    gate = threading.Event()
    files.add("/slow.gguf", adapter_bytes, gate=gate)
    adir = tmp_path / "adapters"
    adir.mkdir()
    write_tiny_lora(adir / "local.gguf", seed=42)
    remote: list[httpx.Response] = []
    with serving(tiny_model, allow_private_networks=True, adapter_dirs=(str(adir),)) as (srv, eng, _):
        worker = threading.Thread(target=lambda: remote.append(load(srv, "remote", files.url("/slow.gguf"))))
        worker.start()
        try:
            wait_for(lambda: files.for_path("/slow.gguf"), "the download to start")
            assert load(srv, "local", "local.gguf", timeout=60).status_code == 200
            r = httpx.post(srv.url + "/v1/unload_lora_adapter", json={"lora_name": "local"}, headers=AUTH, timeout=60)
            assert r.status_code == 200
            assert remote == [] and worker.is_alive()  # the download was still held back all along
        finally:
            gate.set()
            worker.join(120)
        assert remote[0].status_code == 200 and "remote" in eng.adapters


def test_one_download_per_source(tiny_model: Path, files: Server, adapter_bytes: bytes) -> None:
    gate = threading.Event()
    files.add("/same.gguf", adapter_bytes, gate=gate)
    url = files.url("/same.gguf")
    results: list[httpx.Response] = []
    with serving(tiny_model, allow_private_networks=True) as (srv, eng, state):
        workers = [threading.Thread(target=lambda n=n: results.append(load(srv, n, url))) for n in ("r1", "r2")]
        for w in workers:
            w.start()
        try:
            wait_for(lambda: state.pool.fetching.get(url) == 2, "both loads to ask for the source")
            assert state.pool.downloading.get(url) == 1  # the second waits for the first's download
        finally:
            gate.set()
            for w in workers:
                w.join(120)
        assert sorted(r.status_code for r in results) == [200, 200]
        assert {"r1", "r2"} <= set(eng.adapters)
        assert len([r for r in files.for_path("/same.gguf") if r.method == "GET"]) == 1
        assert state.pool.fetching == {} and state.pool.downloading == {}


def test_client_that_leaves_cancels_its_download(tiny_model: Path, files: Server, tmp_path: Path) -> None:
    size = 2 << 20  # 128 pieces of 16 KiB, 0.2 s apart: about 26 s if nothing cancels it
    files.add("/long.gguf", b"GGUF" + bytes(size - 4), chunk_delay=0.2)
    url = files.url("/long.gguf")
    with serving(tiny_model, allow_private_networks=True) as (srv, eng, state):
        with pytest.raises(httpx.ReadTimeout):
            load(srv, "long", url, timeout=1.0)  # the client gives up and closes its connection
        wait_for(lambda: not state.pool.fetching, "the download to end", timeout=120)
        (request,) = files.for_path("/long.gguf")
        wait_for(lambda: request.done, "the file server to notice")
        assert request.sent < size // 2, request.sent
        assert "long" not in eng.adapters and httpx.get(srv.url + "/health").status_code == 200


# ------------------------------------------------------------------------------ how sources are shown
def test_sources_are_shown_without_credentials_or_directories(tiny_model: Path, files: Server,
                                                              adapter_bytes: bytes, tmp_path: Path,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    files.add("/r.gguf", adapter_bytes)
    local = tmp_path / "private-dir" / "pinned.gguf"
    local.parent.mkdir()
    write_tiny_lora(local, seed=43)
    signed = files.url("/r.gguf").replace("://", f"://user:{PASSWORD}@", 1) + \
        f"?X-Amz-Signature={SIGNATURE}&X-Amz-Credential=AKIA"
    caplog.set_level(logging.DEBUG)
    with serving(tiny_model, loras=(("pinned", str(local)),), allow_private_networks=True) as (srv, _, _):
        assert load(srv, "remote", signed).status_code == 200
        missing = files.url("/missing.gguf").replace("://", f"://user:{PASSWORD}@", 1) + f"?sig={SIGNATURE}"
        r = load(srv, "gone", missing)
        assert r.status_code == 502 and "HTTP 404" in error(r)["message"]
        shown = [r.text]
        for path in ("/v1/models", "/lora-adapters"):
            public = httpx.get(srv.url + path)
            assert public.status_code == 200
            shown.append(public.text)
        for text in (*shown, caplog.text):
            assert PASSWORD not in text and SIGNATURE not in text and "AKIA" not in text
        for text in shown:
            assert str(tmp_path) not in text and "private-dir" not in text
        models = {m["id"]: m for m in httpx.get(srv.url + "/v1/models").json()["data"]}
        assert models["pinned"]["root"] == "pinned.gguf"
        assert models["remote"]["root"] == f"http://127.0.0.1:{files.port}/r.gguf?…"
        assert "/" not in models["tiny"]["root"]
        admin = {m["id"]: m for m in httpx.get(srv.url + "/v1/models", headers=AUTH).json()["data"]}
        assert admin["pinned"]["root"] == str(local)  # the admin plane sees where a file is
        assert PASSWORD not in json.dumps(admin) and SIGNATURE not in json.dumps(admin)
