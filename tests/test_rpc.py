"""A base model split over llama.cpp RPC workers: two `loramux rpc-worker`s on 127.0.0.1 (two ports).

The cases that need RPC run on a Python whose llama.cpp was built with -DGGML_RPC=on: LORAMUX_DET_PYTHON
(scripts/det-venv.sh builds that variant with RPC on; .ci/run sets it), else this interpreter if its
build has RPC. Without one they skip and say so. Workers and servers are subprocesses of the test,
killed at its end.

- greedy outputs with the base split over two workers equal the same requests run locally (same build):
  base, an adapter, a stack, after an in-place factor write, a control vector, two adapters decoded
  together through the slot bank (its device-memory mask path: the nodes are on the workers);
- a worker that is not there is a typed RpcError at load, not llama.cpp's abort;
- a worker that dies under a server: requests get a typed 503 (rpc_unavailable), and once the worker is
  back the server has restarted itself and answers as before;
- `rpc-worker --cache` against a hostile peer that asks ggml-rpc to cache every upload: the cache
  directory stays within --cache-max-files (loramux's keeper), every entry named by ggml-rpc's hash.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from loramux import _native as N
from loramux.engine import rpc
from loramux.engine.options import EngineOptions
from loramux.engine.rpc_cache import MANIFEST
from loramux.errors import ParameterError, RpcError

REPO = Path(__file__).resolve().parent.parent
CHECK = Path(__file__).parent / "rpc_check.py"


def _rpc_python() -> str | None:
    for py in (os.environ.get("LORAMUX_DET_PYTHON"), sys.executable):
        if not py:
            continue
        r = subprocess.run([py, "-c", "from loramux import _native as N; print(N.rpc_supported())"],
                           capture_output=True, text=True, env=_env(), timeout=120)
        if r.returncode == 0 and r.stdout.strip() == "True":
            return py
    return None


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")]),
            "OMP_WAIT_POLICY": "PASSIVE"}


@pytest.fixture(scope="module")
def rpc_python() -> str:
    py = _rpc_python()
    if py is None:
        pytest.skip("needs llama.cpp built with -DGGML_RPC=on: set LORAMUX_DET_PYTHON to the Python that "
                    "scripts/det-venv.sh makes (it builds that variant), or install the binding with "
                    'CMAKE_ARGS="-DGGML_RPC=on"')
    return py


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Worker:
    """`loramux rpc-worker` on 127.0.0.1:port, as a subprocess."""

    def __init__(self, python: str, port: int, log: Path, extra: tuple[str, ...] = ()) -> None:
        self.python, self.port, self.log, self.extra = python, port, log, extra
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> Worker:
        with open(self.log, "ab") as f:
            self.proc = subprocess.Popen([self.python, "-m", "loramux", "rpc-worker", "--port", str(self.port),
                                          "--threads", "1", *self.extra], stdout=f, stderr=subprocess.STDOUT, env=_env())
        deadline = time.monotonic() + 60
        while True:
            try:
                rpc.probe(self.endpoint, timeout=2)
                return self
            except RpcError:
                assert self.proc.poll() is None, self.log.read_text()
                assert time.monotonic() < deadline, f"worker on {self.port} did not answer: {self.log.read_text()}"
                time.sleep(0.2)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)


@pytest.fixture()
def workers(rpc_python: str, tmp_path: Path):
    ws = [Worker(rpc_python, _free_port(), tmp_path / f"worker{i}.log") for i in range(2)]
    try:
        for w in ws:
            w.start()
        yield ws
    finally:
        for w in ws:
            w.kill()


# ------------------------------------------------------------------------------------------ no RPC needed
def test_endpoints_are_checked():
    assert EngineOptions(rpc="h1:50052, h2:1").rpc == ("h1:50052", "h2:1")
    assert EngineOptions(rpc=["h:7"]).rpc == ("h:7",)
    for bad, word in (("h1", "HOST:PORT"), ("h:0", "1-65535"), ("h:x", "1-65535"), ("h:1,h:1", "twice"),
                      ("fe80::1:5", "IPv6")):
        with pytest.raises(ParameterError, match=word) as e:
            EngineOptions(rpc=bad)
        assert e.value.parameter == "rpc"


def test_build_without_rpc_is_a_typed_error_saying_how_to_install(tiny_model):
    if N.rpc_supported():
        pytest.skip("this interpreter's llama.cpp has RPC")
    import loramux as lm

    with pytest.raises(RpcError) as e:
        lm.Engine.load(tiny_model, rpc=["127.0.0.1:50052"])
    assert e.value.reason == "unsupported" and "-DGGML_RPC=on" in str(e.value)


def test_probe_of_a_closed_port_is_unreachable():
    with pytest.raises(RpcError) as e:
        rpc.probe(f"127.0.0.1:{_free_port()}", timeout=2)
    assert e.value.reason == "unreachable" and "loramux rpc-worker" in str(e.value)


def test_a_lost_engine_fails_its_requests_and_refuses_new_ones(tiny_model):
    """What the abort callback triggers, on a local engine: the same path without needing a worker to die."""
    import loramux as lm
    from loramux.server.app import create_app, serve_in_thread

    eng = lm.Engine.load(tiny_model, n_ctx=256, n_threads=1)
    with serve_in_thread(create_app(eng)) as srv:
        def submit_then_lose():
            req = eng.submit("the cat", max_tokens=50, ignore_eos=True)  # queued: the step never ran
            eng.fail_lost("ggml-rpc.cpp:566: Remote RPC server crashed or returned malformed response")
            return req
        req = eng.call(submit_then_lose)
        kind, err = req.events.get(timeout=30)
        assert kind == "error" and isinstance(err, RpcError) and err.reason == "lost", (kind, err)
        with pytest.raises(RpcError, match="Remote RPC server crashed"):
            eng.generate("the cat", max_tokens=2)
        status, body = _post(srv.url + "/v1/completions", {"prompt": "the cat", "max_tokens": 2})
        assert status == 503 and body["error"]["code"] == "rpc_unavailable", (status, body)
        assert eng.closed
    eng.close()  # returns at once: a lost engine's native handles are never touched again


# ------------------------------------------------------------------------------------------ with RPC
@pytest.mark.slow
def test_split_over_two_workers_equals_local(rpc_python, workers, tiny_dir):
    r = subprocess.run([rpc_python, str(CHECK), str(tiny_dir / "tiny.gguf"), str(tiny_dir / "a.gguf"),
                        str(tiny_dir / "b.gguf"), ",".join(w.endpoint for w in workers)],
                       capture_output=True, text=True, env=_env(), timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    local, remote = res["local"], res["remote"]
    for case in ("base", "adapter", "stack", "inplace", "control", "bank"):
        assert remote[case] == local[case], (case, local[case], remote[case])
    # the cases really differ from each other, so equality above says something
    assert len({json.dumps(local[c]) for c in ("base", "adapter", "stack", "inplace", "control")}) == 5, local
    assert remote["readback_exact"] and local["readback_exact"]
    assert res["adapter_on_host"] is False  # the adapter's tensors were placed on the workers
    assert remote["shared_steps"] > 0  # the two adapters shared decode steps through the bank
    assert remote["bank_row_transfers"]["sets"] > 0  # masks went through ggml_backend_tensor_set
    assert local["bank_row_transfers"]["sets"] == 0  # locally they are applied in host memory


@pytest.mark.slow
def test_missing_worker_is_a_typed_error_not_an_abort(rpc_python, workers, tiny_dir):
    gone = f"127.0.0.1:{_free_port()}"
    code = ("import loramux as lm, sys\nfrom loramux.errors import RpcError\n"
            f"try:\n    lm.Engine.load({str(tiny_dir / 'tiny.gguf')!r}, rpc=[{workers[0].endpoint!r}, {gone!r}])\n"
            "except RpcError as e:\n    print(e.reason, e.endpoint); sys.exit(3)\n")
    r = subprocess.run([rpc_python, "-c", code], capture_output=True, text=True, env=_env(), timeout=120)
    assert r.returncode == 3, (r.returncode, r.stdout, r.stderr[-2000:])
    assert r.stdout.split() == ["unreachable", gone]


def _post(url: str, body: dict, timeout: float = 60) -> tuple[int, dict]:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def _wait_ok(url: str, body: dict, timeout: float, proc: subprocess.Popen[bytes], log: Path) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, log.read_text()[-4000:]
        try:
            status, out = _post(url, body, timeout=30)
            if status == 200:
                return out
        except OSError:
            pass  # not listening (yet, or again)
        assert time.monotonic() < deadline, log.read_text()[-4000:]
        time.sleep(0.5)


@pytest.mark.slow
def test_server_survives_a_dead_worker_and_recovers_when_it_is_back(rpc_python, workers, tiny_dir, tmp_path):
    port, log = _free_port(), tmp_path / "server.log"
    cmd = [rpc_python, "-m", "loramux", "serve", str(tiny_dir / "tiny.gguf"), "--port", str(port),
           "--rpc", ",".join(w.endpoint for w in workers), "--threads", "1", "--parallel", "2",
           "--n-ctx", "256", "--slots", "2", "--slot-rank", "4", "--lora", f"a={tiny_dir / 'a.gguf'}"]
    with open(log, "ab") as f:
        server = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=_env())
    url = f"http://127.0.0.1:{port}/v1/completions"
    body = {"model": "a", "prompt": "the cat sat on", "max_tokens": 8, "temperature": 0}
    try:
        before = _wait_ok(url, body, 120, server, log)["choices"][0]["text"]
        workers[1].kill()
        status, err = _post(url, body)
        assert status == 503 and err["error"]["code"] == "rpc_unavailable", (status, err)
        status, err = _post(url, body)  # refused at once while the worker is away, not hung
        assert status == 503 and err["error"]["code"] == "rpc_unavailable", (status, err)
        pid = server.pid
        workers[1].start()  # the same port again
        after = _wait_ok(url, body, 180, server, log)["choices"][0]["text"]
        assert after == before
        assert server.pid == pid and "restarting the server" in log.read_text()
    finally:
        if server.poll() is None:
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(30)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait(30)


# ------------------------------------------------------------------- a hostile peer of a caching worker
RPC_TENSOR = struct.Struct("<QIQ4I4II16ii10QQQQ64si")  # ggml-rpc's rpc_tensor (packed: 296 bytes)
CMD_ALLOC_BUFFER, CMD_BUFFER_GET_BASE, CMD_SET_TENSOR, CMD_DEVICE_COUNT = 0, 3, 6, 15


def _call(s: socket.socket, cmd: int, payload: bytes, reply: int | None) -> bytes:
    s.sendall(struct.pack("<BQ", cmd, len(payload)) + payload)
    if reply is None:
        return b""
    size = struct.unpack("<Q", _read(s, 8))[0]
    assert size == reply, (cmd, size)
    return _read(s, size)


def _read(s: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = s.recv(n - len(out))
        assert chunk, "the worker closed the connection"
        out += chunk
    return out


def _cached_uploads(endpoint: str, blobs: list[bytes]) -> None:
    """What any peer may do: allocate a buffer and upload `blobs` into it, each with ggml-rpc's cache
    flag set (the worker then writes each to its cache directory)."""
    host, _, port = endpoint.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        _call(s, N.RPC_HELLO, bytes(N.RPC_CONN_CAPS), 4 + N.RPC_CONN_CAPS)
        size = max(len(b) for b in blobs)
        buf, _ = struct.unpack("<QQ", _call(s, CMD_ALLOC_BUFFER, struct.pack("<IQ", 0, size), 16))
        (base,) = struct.unpack("<Q", _call(s, CMD_BUFFER_GET_BASE, struct.pack("<Q", buf), 8))
        for blob in blobs:
            n = len(blob)
            tensor = RPC_TENSOR.pack(1, 0, buf, n // 4, 1, 1, 1, 4, n, n, n, 0, *[0] * 16, 0, *[0] * 10, 0, 0, base,
                                     b"hostile", 0)
            _call(s, CMD_SET_TENSOR, tensor + b"\x01" + struct.pack("<Q", 0) + blob, None)
        _call(s, CMD_DEVICE_COUNT, b"", 4)  # answered once every upload before it was handled


def _fnv1a64(data: bytes) -> int:
    h = 0xCBF29CE484222325
    for b in data:
        h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


@pytest.mark.slow
def test_a_caching_worker_stays_within_its_bounds_against_a_hostile_peer(rpc_python, tmp_path):
    cache = tmp_path / "cache"
    w = Worker(rpc_python, _free_port(), tmp_path / "worker.log",
               extra=("--cache", str(cache), "--cache-max-files", "2")).start()
    try:
        blobs = [bytes([i]) * 4096 for i in range(1, 7)]
        _cached_uploads(w.endpoint, blobs)
        deadline = time.monotonic() + 60
        while len([p for p in cache.iterdir() if p.name != MANIFEST]) > 2:  # the keeper's next pass
            assert time.monotonic() < deadline, sorted(p.name for p in cache.iterdir())
            time.sleep(0.2)
        kept = [p for p in cache.iterdir() if p.name != MANIFEST]
        assert 1 <= len(kept) <= 2, kept
        for p in kept:  # what ggml-rpc wrote, under the name ggml-rpc gives it
            assert p.read_bytes() in blobs and p.name == f"{_fnv1a64(p.read_bytes()):016x}", p.name
        assert w.proc.poll() is None and rpc.probe(w.endpoint, timeout=10)[0] == N.RPC_PROTO_MAJOR
    finally:
        w.kill()
