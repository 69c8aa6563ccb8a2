"""The binding and the libraries: llama-cpp-python's import and version pin, llama.cpp's log routed to
Python `logging`, the already-loaded libggml-base with the argtypes loramux uses, `system_info`, the
batch-invariant kernel switch, and `llama_model_quantize` with its file types. Every other submodule of
the boundary imports `C` from here, so the pin is checked before any native call.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from typing import Any

import numpy as np

from .. import ggml_types as G
from ..errors import BackendError

PINNED_VERSION = "0.3.36"

try:
    import llama_cpp
    import llama_cpp.llama_cpp as C
except ImportError as e:  # pragma: no cover - install problem
    raise BackendError("import llama_cpp", None, str(e),
                       hint=f"install the pinned binding: pip install llama-cpp-python=={PINNED_VERSION}") from e

if getattr(llama_cpp, "__version__", None) != PINNED_VERSION:  # pragma: no cover - install problem
    raise BackendError("import llama_cpp", None,
                       f"loramux needs llama-cpp-python {PINNED_VERSION}, found {llama_cpp.__version__}",
                       hint=f"pip install llama-cpp-python=={PINNED_VERSION} (in-place writes rely on this build's internals)")

log = logging.getLogger("loramux.llama")

# --------------------------------------------------------------------------------------------
# Library setup: backend, log routing, libggml-base
# --------------------------------------------------------------------------------------------

# enum ggml_log_level: NONE 0, DEBUG 1, INFO 2, WARN 3, ERROR 4, CONT 5 (continues the previous line)
_LEVELS = {1: logging.DEBUG, 2: logging.INFO, 3: logging.WARNING, 4: logging.ERROR}
_last_level = [logging.DEBUG]
# Quiet by default: llama.cpp is chatty. Configure logging (or --log-level) to see it.
log.addHandler(logging.NullHandler())

grammar_log = threading.local()  # llama.cpp's parse messages, collected on the creating thread (sampling.py)


def _grammar_log_hook(level: int, text: bytes) -> None:
    if level not in (3, 4, 5):
        return
    lines = getattr(grammar_log, "lines", None)
    if lines is not None:
        lines.append(text.decode("utf-8", errors="replace").rstrip("\n"))


@C.llama_log_callback
def _log_cb(level: int, text: bytes, _user: Any) -> None:
    # Runs on llama.cpp's threads; logging is thread-safe. Never raise into C.
    try:
        lvl = _last_level[0] if level == 5 else _LEVELS.get(level, logging.DEBUG)
        _last_level[0] = lvl
        _grammar_log_hook(level, text)
        # llama.cpp writes hundreds of debug lines per graph reserve and adapter load (on the engine
        # thread): drop what nobody listens to before decoding it
        if log.isEnabledFor(lvl):
            msg = text.decode("utf-8", errors="replace").rstrip("\n")
            if msg:
                log.log(lvl, msg)
    except Exception:  # noqa: BLE001
        pass


C.llama_log_set(_log_cb, ctypes.c_void_p(0))
C.llama_backend_init()


def _load_ggml() -> ctypes.CDLL:
    # The wheel ships several copies of libggml-base; opening one by path would map a second ggml
    # whose globals differ from the one libllama uses. Take the already-loaded one by SONAME.
    mode = os.RTLD_NOLOAD | os.RTLD_GLOBAL
    for name in ("libggml-base.so.0", "libggml-base.so", "libggml-base.dylib"):
        try:
            return ctypes.CDLL(name, mode=mode)
        except OSError:
            continue
    libdir = os.path.join(os.path.dirname(llama_cpp.__file__), "lib")
    for name in sorted(os.listdir(libdir)) if os.path.isdir(libdir) else []:
        if name.startswith("libggml-base"):
            try:
                return ctypes.CDLL(os.path.join(libdir, name), mode=mode)
            except OSError:
                continue
    raise BackendError("dlopen libggml-base", None, "libggml-base is not loaded in this process",
                       hint="reinstall llama-cpp-python; loramux needs the ggml it ships")


# The ggml that libllama uses (tensors.py and rpc.py call it too).
libggml = _load_ggml()
libggml.ggml_backend_tensor_set.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
libggml.ggml_backend_tensor_set.restype = None
libggml.ggml_backend_tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
libggml.ggml_backend_tensor_get.restype = None
for _fn in (libggml.ggml_backend_tensor_set_2d, libggml.ggml_backend_tensor_get_2d):
    _fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_size_t] * 5
    _fn.restype = None
libggml.ggml_backend_buffer_is_host.argtypes = [ctypes.c_void_p]
libggml.ggml_backend_buffer_is_host.restype = ctypes.c_bool
libggml.ggml_backend_buffer_get_alignment.argtypes = [ctypes.c_void_p]
libggml.ggml_backend_buffer_get_alignment.restype = ctypes.c_size_t
libggml.ggml_nbytes.argtypes = [ctypes.c_void_p]
libggml.ggml_nbytes.restype = ctypes.c_size_t
libggml.ggml_get_name.argtypes = [ctypes.c_void_p]
libggml.ggml_get_name.restype = ctypes.c_char_p
libggml.ggml_op_name.argtypes = [ctypes.c_int]
libggml.ggml_op_name.restype = ctypes.c_char_p
libggml.ggml_tensor_overhead.argtypes = []
libggml.ggml_tensor_overhead.restype = ctypes.c_size_t
libggml.ggml_backend_sched_set_eval_callback.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
libggml.ggml_backend_sched_set_eval_callback.restype = None

# `llama_context::get_sched() const`, exported by libllama (a C++ member function: `this` is its one
# argument). A context's scheduler is where its eval callback lives between decodes: llama.cpp copies
# `cparams.cb_eval` into it whenever it builds a graph (a reused graph keeps what the scheduler has),
# and it makes a new scheduler whenever it re-reserves (an adapter-set change). None where the
# symbol is missing: every decode then keeps the context's callback.
_GET_SCHED = getattr(getattr(C, "_lib", None), "_ZNK13llama_context9get_schedEv", None)  # the binding's libllama
if _GET_SCHED is not None:
    _GET_SCHED.argtypes = [ctypes.c_void_p]
    _GET_SCHED.restype = ctypes.c_void_p


def _load_fp16_converter() -> Any:
    """ggml's CPU F16 → F32 row converter (SIMD), from the libggml-cpu libllama already loaded; None where
    the build has no such library under its usual name (a build of per-CPU backend variants)."""
    for name in ("libggml-cpu.so.0", "libggml-cpu.so", "libggml-cpu.dylib"):
        try:
            fn = ctypes.CDLL(name, mode=os.RTLD_NOLOAD | os.RTLD_GLOBAL).ggml_cpu_fp16_to_fp32
        except (OSError, AttributeError):
            continue
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
        fn.restype = None
        return fn
    return None


_FP16_TO_FP32 = _load_fp16_converter()


def decode_floats(raw: np.ndarray, ggml_type: int) -> np.ndarray:
    """Stored elements of a float type (`ggml_types.STORAGE_DTYPE`) → a new float32 array, the values of
    `ggml_types.decode`. F16 goes through ggml's converter: numpy's F16 cast runs element by element
    (2.5 ms for a rank-8 adapter of Gemma 3 270M, most of its parse), ggml's in 0.1 ms, without the GIL."""
    if ggml_type != G.F16 or _FP16_TO_FP32 is None or raw.dtype != np.float16:
        return G.decode(raw, ggml_type)
    src = np.ascontiguousarray(raw)
    out = np.empty(src.shape, np.float32)
    if src.size:
        _FP16_TO_FP32(src.ctypes.data, out.ctypes.data, src.size)
    return out


def set_sched_eval_callback(ctx: Any, callback: Any) -> bool:
    """Give the scheduler of llama_context `ctx` this eval callback (a ctypes callback, or None: no
    callback, so the graph runs without asking about each node); False where that is not possible."""
    if _GET_SCHED is None:
        return False
    sched = _GET_SCHED(ctx)
    if not sched:
        return False
    ptr = ctypes.cast(callback, ctypes.c_void_p) if callback is not None else None
    libggml.ggml_backend_sched_set_eval_callback(sched, ptr, None)
    return True



# `llama_graph_reserve(ctx, n_tokens, n_seqs, n_outputs)` (llama-ext.h, declared without extern "C", so
# exported under its C++ name): builds the graph the context would compute for a ubatch of that size,
# its adapter set included, and plans its buffers; nothing is computed. Adapter discovery reads the
# graph's nodes from it instead of running a decode. None where the symbol is missing.
_GRAPH_RESERVE = getattr(getattr(C, "_lib", None), "_Z19llama_graph_reserveP13llama_contextjjj", None)
if _GRAPH_RESERVE is not None:
    _GRAPH_RESERVE.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_uint32, ctypes.c_uint32]
    _GRAPH_RESERVE.restype = ctypes.c_void_p
libggml.ggml_graph_n_nodes.argtypes = [ctypes.c_void_p]
libggml.ggml_graph_n_nodes.restype = ctypes.c_int
libggml.ggml_graph_node.argtypes = [ctypes.c_void_p, ctypes.c_int]
libggml.ggml_graph_node.restype = ctypes.c_void_p


def reserved_graph_nodes(ctx: Any) -> list[int] | None:
    """The nodes of the graph llama_context `ctx` would compute for a one-token ubatch (with its adapters),
    built without computing it; None where that is not possible (then decode with an eval callback).

    The context's scheduler is reset by it: use a context made for this, created after every adapter
    it sets was loaded (llama.cpp sizes a context's graph for the adapters loaded when it is created).
    """
    if _GRAPH_RESERVE is None:
        return None
    gf = _GRAPH_RESERVE(ctx, 1, 1, 1)
    if not gf:
        return None
    return [int(libggml.ggml_graph_node(gf, i) or 0) for i in range(int(libggml.ggml_graph_n_nodes(gf)))]


TILED_ENV = "GGML_CPU_TILED_MM"
# ggml reads GGML_CPU_TILED_MM once, at the first matmul of the process: remember what it saw.
_first_decode_env: str | None = None


def note_first_decode() -> None:
    """Remember the GGML_CPU_TILED_MM that ggml sees at this process's first decode (ContextHandle.decode)."""
    global _first_decode_env
    if _first_decode_env is None:
        _first_decode_env = os.environ.get(TILED_ENV, "")


def enable_batch_invariant_kernels() -> None:
    """Turn off ggml's tiled CPU matmul (its results depend on how many tokens share a matmul).

    Must happen before the first decode of the process; raises BackendError if it is too late.
    """
    if _first_decode_env is None:
        os.environ[TILED_ENV] = "0"
        return
    if _first_decode_env != "0":
        raise BackendError("deterministic mode", None,
                           f"ggml already read {TILED_ENV}={_first_decode_env or '(unset)'} at this process's first decode",
                           hint=f"create the deterministic engine before any other decode, or start the process "
                                f"with {TILED_ENV}=0")


def system_info() -> str:
    return C.llama_print_system_info().decode("utf-8", errors="replace")


def binding_version() -> str:
    return str(llama_cpp.__version__)


# --------------------------------------------------------------------------------------------
# Quantization (used by merge)
# --------------------------------------------------------------------------------------------

def model_quantize(src_path: str, dst_path: str, ftype: int, nthread: int = 0) -> None:
    """Quantize a GGUF model with llama.cpp's `llama_model_quantize`."""
    p = C.llama_model_quantize_default_params()
    p.nthread = nthread
    p.ftype = ftype
    rc = C.llama_model_quantize(os.fsencode(src_path), os.fsencode(dst_path), ctypes.byref(p))
    if rc != 0:
        raise BackendError("llama_model_quantize", rc, f"{src_path} → {dst_path} (ftype {ftype})")


FTYPES: dict[str, int] = {
    name[len("LLAMA_FTYPE_MOSTLY_"):]: int(getattr(C, name))
    for name in dir(C) if name.startswith("LLAMA_FTYPE_MOSTLY_")
}
FTYPES["F32"] = int(getattr(C, "LLAMA_FTYPE_ALL_F32", 0))


__all__ = ["FTYPES", "PINNED_VERSION", "TILED_ENV", "binding_version", "decode_floats",
           "enable_batch_invariant_kernels",
           "grammar_log", "libggml", "log", "model_quantize", "note_first_decode", "set_sched_eval_callback",
           "system_info"]
