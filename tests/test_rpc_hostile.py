"""The RPC probe against hostile peers: a real TCP server on 127.0.0.1 that answers HELLO with a huge
size, never answers, or trickles its answer. The probe always ends with a typed RpcError (never
MemoryError, OverflowError or a hang), and `wait_for_workers` (the loop `serve --rpc` restarts with)
keeps probing instead of dying. No llama.cpp RPC build is needed: the probe is loramux's own code."""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest

from loramux import _native as N
from loramux.engine import rpc
from loramux.errors import RpcError

HANG_GUARD_S = 60  # only so that a broken probe fails the test instead of hanging the suite


@contextmanager
def peer(behaviour: Callable[[socket.socket], None]) -> Iterator[str]:
    """A TCP server on 127.0.0.1 that reads the client's HELLO and then runs `behaviour(conn)`."""
    srv = socket.create_server(("127.0.0.1", 0))
    srv.settimeout(0.2)
    stop = threading.Event()

    def serve_one(conn: socket.socket) -> None:
        with conn:
            try:
                conn.recv(1 + 8 + N.RPC_CONN_CAPS)
                behaviour(conn)
                while not stop.is_set():  # hold the connection open until the client leaves
                    try:
                        if not conn.recv(1):
                            return
                    except TimeoutError:
                        continue
            except OSError:
                pass

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conn.settimeout(0.5)
            threading.Thread(target=serve_one, args=(conn,), daemon=True).start()

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    try:
        yield f"127.0.0.1:{srv.getsockname()[1]}"
    finally:
        stop.set()
        t.join(5)
        srv.close()


def huge_size(conn: socket.socket) -> None:
    conn.sendall(struct.pack("<Q", 2**63 + 5) + b"\x07\x00\x00\x00")


def silent(conn: socket.socket) -> None:
    pass  # accepts, reads the HELLO, never answers


def trickle(conn: socket.socket) -> None:
    conn.sendall(struct.pack("<Q", 4096))  # a size within bounds, then one byte every 0.2 s (~14 min in all)
    for _ in range(4096):
        try:
            conn.sendall(b"\x07")
        except TimeoutError:
            continue
        time.sleep(0.2)


def good_hello(conn: socket.socket) -> None:
    reply = bytes([N.RPC_PROTO_MAJOR, 0, 0, 0]) + bytes(N.RPC_CONN_CAPS)
    conn.sendall(struct.pack("<Q", len(reply)) + reply)


def _probe(endpoint: str, timeout: float) -> BaseException | tuple[int, int, int]:
    """probe() in a thread: its result or exception, and a test failure (not a hang) if it never ends."""
    out: list[BaseException | tuple[int, int, int]] = []

    def run() -> None:
        try:
            out.append(rpc.probe(endpoint, timeout=timeout))
        except BaseException as e:  # noqa: BLE001 - MemoryError, OverflowError: what the test looks for
            out.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(HANG_GUARD_S)
    assert out, f"probe({endpoint}, timeout={timeout}) still running after {HANG_GUARD_S} s"
    return out[0]


def test_a_hostile_hello_size_is_a_typed_error():
    with peer(huge_size) as ep:
        e = _probe(ep, timeout=5)
    assert isinstance(e, RpcError), repr(e)
    assert e.reason == "version" and "bytes" in str(e) and e.endpoint == ep, str(e)


@pytest.mark.parametrize("behaviour", [silent, trickle], ids=["silent", "trickle"])
def test_a_slow_peer_is_cut_off_by_the_probe_timeout(behaviour):
    with peer(behaviour) as ep:
        e = _probe(ep, timeout=1)
    assert isinstance(e, RpcError), repr(e)
    assert e.reason == "unreachable" and "no answer within 1 s" in str(e), str(e)


def test_wait_for_workers_outlives_hostile_peers():
    """The restart loop of `serve --rpc` keeps probing past hostile answers and returns once a worker
    answers a proper HELLO."""
    for behaviour in (huge_size, silent):
        with peer(behaviour) as ep:
            assert rpc.wait_for_workers([ep], interval=0.1, timeout=1) is False
    with peer(good_hello) as ep:
        assert _probe(ep, timeout=5) == (N.RPC_PROTO_MAJOR, 0, 0)
        assert rpc.wait_for_workers([ep], interval=0.1, timeout=30) is True


def test_a_malformed_endpoint_is_a_typed_error():
    for bad in ("nohost", "h:", ":5", "h:0", "h:99999", "h:x"):
        with pytest.raises(RpcError) as e:
            rpc.probe(bad, timeout=1)
        assert e.value.reason == "invalid" and "HOST:PORT" in str(e.value), bad
