"""llama.cpp's RPC backend (ggml-rpc): looking it up through ggml's backend registry, connecting to
workers and listing their devices, serving as a worker, and turning ggml-rpc's aborts on a lost worker
into a Python event.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable
from typing import Any

from ..errors import BackendError
from .lib import PINNED_VERSION, libggml, log

# --------------------------------------------------------------------------------------------
# llama.cpp's RPC backend (ggml-rpc): workers that hold part of a base model
# --------------------------------------------------------------------------------------------
# Only a build with -DGGML_RPC=on has it; everything here is looked up through ggml's backend registry
# (ggml_backend_reg_by_name("RPC") + get_proc_address), so it works whether ggml-rpc is linked into
# libggml or loaded as a backend module, and a build without it only makes rpc_supported() False.
#
# ggml-rpc aborts the process (GGML_ABORT) when a worker cannot be reached or dies mid-call. The
# abort callback below turns the RPC ones into a Python event instead: it tells the listeners and then
# parks the calling thread for good, so the process lives on (its RPC connection is gone for the rest of
# the process; see engine/rpc.py for how the server recovers). Any other abort still aborts.

RPC_HELLO = 14               # RPC_CMD_HELLO, fixed across protocol versions (static_assert in ggml-rpc.cpp)
RPC_CONN_CAPS = 24           # RPC_CONN_CAPS_SIZE (ggml-rpc/transport.h) of this build's protocol
RPC_PROTO_MAJOR = 7          # RPC_PROTO_MAJOR_VERSION of ggml-rpc.h in the pinned llama.cpp
_RPC_ABORT_MARKS = ("RPC", "Failed to connect to ")


def _load_ggml_reg() -> ctypes.CDLL | None:
    for name in ("libggml.so.0", "libggml.so", "libggml.dylib"):
        try:
            return ctypes.CDLL(name, mode=os.RTLD_NOLOAD | os.RTLD_GLOBAL)
        except OSError:
            continue
    return None


_ggml_reg = _load_ggml_reg()
if _ggml_reg is not None:
    _ggml_reg.ggml_backend_reg_by_name.argtypes = [ctypes.c_char_p]
    _ggml_reg.ggml_backend_reg_by_name.restype = ctypes.c_void_p
    _ggml_reg.ggml_backend_reg_get_proc_address.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    _ggml_reg.ggml_backend_reg_get_proc_address.restype = ctypes.c_void_p
    _ggml_reg.ggml_backend_reg_dev_count.argtypes = [ctypes.c_void_p]
    _ggml_reg.ggml_backend_reg_dev_count.restype = ctypes.c_size_t
    _ggml_reg.ggml_backend_reg_dev_get.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    _ggml_reg.ggml_backend_reg_dev_get.restype = ctypes.c_void_p
    _ggml_reg.ggml_backend_dev_by_type.argtypes = [ctypes.c_int]
    _ggml_reg.ggml_backend_dev_by_type.restype = ctypes.c_void_p
    _ggml_reg.ggml_backend_dev_name.argtypes = [ctypes.c_void_p]
    _ggml_reg.ggml_backend_dev_name.restype = ctypes.c_char_p
    _ggml_reg.ggml_backend_dev_count.argtypes = []
    _ggml_reg.ggml_backend_dev_count.restype = ctypes.c_size_t
    _ggml_reg.ggml_backend_dev_get.argtypes = [ctypes.c_size_t]
    _ggml_reg.ggml_backend_dev_get.restype = ctypes.c_void_p
    _ggml_reg.ggml_backend_dev_type.argtypes = [ctypes.c_void_p]
    _ggml_reg.ggml_backend_dev_type.restype = ctypes.c_int

_RpcAddServer = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_char_p)
_RpcStartServer = ctypes.CFUNCTYPE(None, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_size_t,
                                   ctypes.POINTER(ctypes.c_void_p))
_AbortCallback = ctypes.CFUNCTYPE(None, ctypes.c_char_p)
libggml.ggml_set_abort_callback.argtypes = [_AbortCallback]
libggml.ggml_set_abort_callback.restype = ctypes.c_void_p
_rpc_lock = threading.Lock()
_rpc_listeners: list[Callable[[str], None]] = []
_rpc_connected: set[str] = set()   # endpoints this process holds a connection to (one per endpoint)
_rpc_lost: list[str] = []          # abort messages seen; non-empty: this process's RPC state is broken


def _rpc_reg() -> int:
    reg = _ggml_reg.ggml_backend_reg_by_name(b"RPC") if _ggml_reg is not None else None
    return int(reg or 0)


def rpc_supported() -> bool:
    """True when this llama.cpp was built with its RPC backend (-DGGML_RPC=on)."""
    return _rpc_reg() != 0


def _rpc_proc(name: str, kind: Any) -> Any:
    reg = _rpc_reg()
    addr = _ggml_reg.ggml_backend_reg_get_proc_address(reg, name.encode()) if reg and _ggml_reg else None
    if not addr:
        raise BackendError(name, None, "this llama.cpp has no RPC backend",
                           hint='reinstall the binding with RPC: CMAKE_ARGS="-DGGML_RPC=on" pip install '
                                f'--force-reinstall --no-cache-dir llama-cpp-python=={PINNED_VERSION}')
    return kind(addr)


@_AbortCallback
def _abort_cb(message: bytes | None) -> None:
    # Runs on the thread that hit GGML_ABORT, just before abort(). Never raise into C.
    text = (message or b"").decode("utf-8", errors="replace")
    if not any(mark in text for mark in _RPC_ABORT_MARKS):
        return  # not ours: abort as ggml always did
    try:
        with _rpc_lock:
            _rpc_lost.append(text)
            listeners = list(_rpc_listeners)
        log.error("RPC worker lost: %s", text)
        for fn in listeners:
            try:
                fn(text)
            except Exception:  # noqa: BLE001
                log.exception("RPC-loss listener failed")
    finally:
        # Parking (not returning) is what keeps abort() from running. The thread holds no Python
        # locks while it waits; its llama.cpp call never returns.
        threading.Event().wait()


def rpc_on_lost(fn: Callable[[str], None]) -> None:
    """Call `fn(message)` (on a llama.cpp thread, once per loss) when an RPC worker is lost.

    From the first call on, ggml's aborts for a lost worker park the failing thread instead of ending
    the process; the process must not use RPC again (rpc_broken() is then True).
    """
    with _rpc_lock:
        _rpc_listeners.append(fn)
        first = len(_rpc_listeners) == 1
    if first:
        libggml.ggml_set_abort_callback(_abort_cb)


def rpc_broken() -> str | None:
    """The first RPC loss this process saw (ggml's message), or None."""
    with _rpc_lock:
        return _rpc_lost[0] if _rpc_lost else None


def rpc_connected(endpoint: str) -> bool:
    """True when this process already holds ggml-rpc's connection to `endpoint`."""
    with _rpc_lock:
        return endpoint in _rpc_connected


def rpc_devices(endpoint: str) -> list[int]:
    """Connect to the worker at `endpoint` ("host:port") and return its devices (ggml_backend_dev_t).

    Connects once per endpoint and process (ggml-rpc keeps the connection). Probe the worker first
    (engine/rpc.py does): ggml aborts, or with rpc_on_lost parks, when it cannot connect.
    """
    add_server = _rpc_proc("ggml_backend_rpc_add_server", _RpcAddServer)
    reg = add_server(endpoint.encode())
    if not reg:
        raise BackendError("ggml_backend_rpc_add_server", None, f"the worker at {endpoint} has no devices")
    with _rpc_lock:
        _rpc_connected.add(endpoint)
    n = _ggml_reg.ggml_backend_reg_dev_count(reg)
    return [int(_ggml_reg.ggml_backend_reg_dev_get(reg, i)) for i in range(n)]


def rpc_worker_devices() -> list[tuple[int, str]]:
    """The devices a worker serves, as llama.cpp's rpc-server picks them: the GPUs (dedicated or
    integrated) of this build, else the CPU. (pointer, name) pairs."""
    devs = [_ggml_reg.ggml_backend_dev_get(i) for i in range(_ggml_reg.ggml_backend_dev_count())] if _ggml_reg else []
    gpus = [d for d in devs if _ggml_reg.ggml_backend_dev_type(d) in (1, 2)]  # GPU, IGPU
    chosen = gpus or [d for d in devs if _ggml_reg.ggml_backend_dev_type(d) == 0][:1]  # CPU
    return [(int(d), _ggml_reg.ggml_backend_dev_name(d).decode("utf-8", "replace")) for d in chosen]


def rpc_serve(endpoint: str, *, n_threads: int, cache_dir: str | None = None) -> None:
    """Run llama.cpp's RPC server on `endpoint` with rpc_worker_devices(). Blocks for good.

    Returns only if the server could not start (bad endpoint, port in use: ggml prints why).
    """
    start = _rpc_proc("ggml_backend_rpc_start_server", _RpcStartServer)
    chosen = rpc_worker_devices()
    if not chosen:
        raise BackendError("ggml_backend_dev_get", None, "this llama.cpp has no device to serve")
    devices = (ctypes.c_void_p * len(chosen))(*(d for d, _ in chosen))
    start(endpoint.encode(), os.fsencode(cache_dir) if cache_dir else None, n_threads, len(chosen), devices)


__all__ = ["RPC_CONN_CAPS", "RPC_HELLO", "RPC_PROTO_MAJOR", "rpc_broken", "rpc_connected", "rpc_devices",
           "rpc_on_lost", "rpc_serve", "rpc_supported", "rpc_worker_devices"]
