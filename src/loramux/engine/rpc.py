"""A base model split over llama.cpp RPC workers (`loramux rpc-worker`): endpoints, probes, loss.

`Engine.load(path, rpc=["h1:50052", "h2:50052"])` offloads every layer llama.cpp can offload to the
workers (split by their free memory, as llama.cpp does); the token embeddings and sampling stay in
this process. Adapters, control vectors and the slot bank live next to the layers they modify, so
their tensors are on the workers too and every in-place write goes through ggml_backend_tensor_set.

Two facts of ggml-rpc shape this module:
- it aborts the process when it cannot connect, so every worker is probed here first (a TCP connect
  and the protocol's HELLO, which also checks the protocol version) and a failure is a typed
  `RpcError` instead;
- it also aborts when a worker dies mid-call. `_native.rpc_on_lost` keeps the process alive instead,
  but its RPC connection is gone for good: the engine fails every request with `RpcError(reason="lost")`
  and refuses new ones, and the server restarts itself in place once the workers answer again
  (`wait_for_workers`, used by `loramux serve`; see docs/distributed.md).
"""

from __future__ import annotations

import inspect
import os
import socket
import struct
import time
import weakref
from collections.abc import Callable, Sequence

from .. import _native as N
from ..errors import RpcError
from .options import parse_endpoint, parse_endpoints  # noqa: F401 - re-exported for callers

INSTALL_HINT = ('install llama-cpp-python with its RPC backend: CMAKE_ARGS="-DGGML_RPC=on" pip install '
                f'--force-reinstall --no-cache-dir llama-cpp-python=={N.PINNED_VERSION}')
WORKER_HINT = "start it there with `loramux rpc-worker --host HOST --port PORT` (same loramux and llama.cpp build)"
PROBE_TIMEOUT_S = 5.0


HELLO_REPLY_MAX = 4096  # bytes: this build's HELLO reply is 4 + RPC_CONN_CAPS (28); a peer saying more is not a worker


def probe(endpoint: str, timeout: float = PROBE_TIMEOUT_S) -> tuple[int, int, int]:
    """Connect to a worker and do the protocol's HELLO; its protocol version, or a typed RpcError.

    Whatever the peer does, this returns or raises RpcError within `timeout` seconds in all (connect,
    send and reply together: a peer that trickles its answer byte by byte is cut off too), and never
    reads more than HELLO_REPLY_MAX bytes (the reply's size comes from the peer).
    """
    host, _, port = endpoint.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise RpcError(endpoint, "invalid", "is not HOST:PORT", hint="give the worker as host:port, e.g. 10.0.0.2:50052")
    deadline = time.monotonic() + timeout
    try:
        with socket.create_connection((host, int(port)), timeout=timeout) as s:
            s.sendall(struct.pack("<BQ", N.RPC_HELLO, N.RPC_CONN_CAPS) + bytes(N.RPC_CONN_CAPS))
            size = struct.unpack("<Q", _recv(s, 8, deadline))[0]
            if size > HELLO_REPLY_MAX:
                raise RpcError(endpoint, "version", f"answered HELLO with a reply of {size} bytes (at most "
                               f"{HELLO_REPLY_MAX} expected): not a llama.cpp RPC worker", hint=WORKER_HINT)
            reply = _recv(s, size, deadline)
    except TimeoutError as e:
        raise RpcError(endpoint, "unreachable", f"no answer within {timeout:g} s (a worker serves one "
                       "client at a time: is another loramux using it?)", hint=WORKER_HINT) from e
    except OSError as e:
        raise RpcError(endpoint, "unreachable", f"cannot connect ({e.strerror or e})", hint=WORKER_HINT) from e
    if len(reply) < 3:
        raise RpcError(endpoint, "version", "answered HELLO with a malformed reply", hint=WORKER_HINT)
    version = (reply[0], reply[1], reply[2])
    if version[0] != N.RPC_PROTO_MAJOR:
        raise RpcError(endpoint, "version", f"speaks RPC protocol {'.'.join(map(str, version))}, this "
                       f"build speaks {N.RPC_PROTO_MAJOR}.x", hint="run the worker from the same llama.cpp build")
    return version


def _recv(s: socket.socket, n: int, deadline: float) -> bytes:
    """Exactly `n` bytes before `deadline` (time.monotonic()), else TimeoutError or ConnectionResetError."""
    out = bytearray()
    while len(out) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("HELLO reply not complete in time")
        s.settimeout(left)
        chunk = s.recv(min(n - len(out), 65536))
        if not chunk:
            raise ConnectionResetError("the worker closed the connection during HELLO")
        out += chunk
    return bytes(out)


def connect(endpoints: Sequence[str]) -> list[int]:
    """The llama.cpp devices of `endpoints`, each probed first; typed errors, never an abort."""
    if not N.rpc_supported():
        raise RpcError(None, "unsupported", "this llama.cpp was built without its RPC backend", hint=INSTALL_HINT)
    broken = N.rpc_broken()
    if broken:
        raise RpcError(None, "lost", f"this process lost an RPC worker earlier ({broken}); start a new "
                       "process to use RPC again")
    problems: list[RpcError] = []
    for ep in endpoints:
        if not N.rpc_connected(ep):  # our own connection would keep a probe waiting
            try:
                probe(ep)
            except RpcError as e:
                problems.append(e)
    if problems:
        first = problems[0]
        raise RpcError(first.endpoint, first.reason, "; ".join(str(p.message) for p in problems) if
                       len(problems) > 1 else first.message.split(": ", 1)[-1], hint=first.hint)
    devices: list[int] = []
    for ep in endpoints:
        devices.extend(N.rpc_devices(ep))
    return devices


def wait_for_workers(endpoints: Sequence[str], *, interval: float = 1.0, timeout: float | None = None) -> bool:
    """Probe until every worker answers HELLO; False if `timeout` seconds passed first."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        try:
            for ep in endpoints:
                probe(ep, timeout=min(PROBE_TIMEOUT_S, interval * 5))
            return True
        except RpcError:
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(interval)


def lost_error(message: str) -> RpcError:
    """The error every request of an engine gets once its RPC connection broke."""
    return RpcError(None, "lost", f"a worker was lost while serving ({message.strip()})",
                    hint="restart the worker; `loramux serve` reloads itself once every worker answers "
                         "(an Engine in your own process cannot: start a new process)")




def on_lost(fn: Callable[[str], None]) -> None:
    """Call `fn(message)` when this process loses an RPC worker (see `_native.rpc_on_lost`).

    A bound method is held weakly, so an engine that was closed and dropped is not kept alive.
    """
    if not inspect.ismethod(fn):
        N.rpc_on_lost(fn)
        return
    ref = weakref.WeakMethod(fn)

    def call(message: str) -> None:
        method = ref()
        if method is not None:
            method(message)
    N.rpc_on_lost(call)


def release_connections(endpoints: Sequence[str]) -> int:
    """Shut down this process's sockets to `endpoints` (Linux: found through /proc/self/fd).

    A worker serves one client at a time; after a loss the connections ggml-rpc still holds to the
    workers that did not die keep them busy, so they must go before a new process can connect. The
    file descriptors stay open (parked threads hold them); shutdown() is what the worker sees.
    Returns how many were shut down.
    """
    wanted = set()
    for ep in endpoints:
        host, _, port = ep.rpartition(":")
        try:
            wanted |= {(info[4][0], int(port)) for info in socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)}
        except OSError:
            continue
    fd_dir = "/proc/self/fd"
    n = 0
    for name in os.listdir(fd_dir) if os.path.isdir(fd_dir) else []:
        try:
            if not os.readlink(os.path.join(fd_dir, name)).startswith("socket:"):
                continue
            s = socket.socket(fileno=int(name))
        except (OSError, ValueError):
            continue
        try:
            peer = s.getpeername()
            if isinstance(peer, tuple) and (peer[0], peer[1]) in wanted:
                s.shutdown(socket.SHUT_RDWR)
                n += 1
        except OSError:
            pass
        finally:
            s.detach()  # the fd is not ours to close
    return n


__all__ = ["INSTALL_HINT", "connect", "lost_error", "on_lost", "probe",
           "release_connections", "wait_for_workers"]
