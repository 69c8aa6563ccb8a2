"""The one ctypes boundary of loramux: llama.cpp (through llama-cpp-python's low-level module) and ggml.

Everything above this module sees Python values and typed errors. This module:
- checks at import that the binding is the pinned llama-cpp-python (internals differ between builds);
- turns NULL handles and negative status codes into `BackendError(function=..., code=...)`;
- owns handle lifetimes (idempotent `close()`, context managers, callbacks kept referenced);
- mirrors `struct ggml_tensor` to find and rewrite adapter tensors in place, and checks the mirror
  against the library before any write;
- routes llama.cpp's log to Python `logging` (logger ``loramux.llama``, quiet unless configured).
"""

from __future__ import annotations

import ctypes
import logging
import math
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from . import ggml_types as G
from .errors import BackendError

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


@C.llama_log_callback
def _log_cb(level: int, text: bytes, _user: Any) -> None:
    # Runs on llama.cpp's threads; logging is thread-safe. Never raise into C.
    try:
        lvl = _last_level[0] if level == 5 else _LEVELS.get(level, logging.DEBUG)
        _last_level[0] = lvl
        _grammar_log_hook(level, text)
        msg = text.decode("utf-8", errors="replace").rstrip("\n")
        if msg and log.isEnabledFor(lvl):
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


_ggml = _load_ggml()
_ggml.ggml_backend_tensor_set.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
_ggml.ggml_backend_tensor_set.restype = None
_ggml.ggml_backend_tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
_ggml.ggml_backend_tensor_get.restype = None
for _fn in (_ggml.ggml_backend_tensor_set_2d, _ggml.ggml_backend_tensor_get_2d):
    _fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_size_t] * 5
    _fn.restype = None
_ggml.ggml_backend_buffer_is_host.argtypes = [ctypes.c_void_p]
_ggml.ggml_backend_buffer_is_host.restype = ctypes.c_bool
_ggml.ggml_backend_buffer_get_alignment.argtypes = [ctypes.c_void_p]
_ggml.ggml_backend_buffer_get_alignment.restype = ctypes.c_size_t
_ggml.ggml_nbytes.argtypes = [ctypes.c_void_p]
_ggml.ggml_nbytes.restype = ctypes.c_size_t
_ggml.ggml_get_name.argtypes = [ctypes.c_void_p]
_ggml.ggml_get_name.restype = ctypes.c_char_p
_ggml.ggml_op_name.argtypes = [ctypes.c_int]
_ggml.ggml_op_name.restype = ctypes.c_char_p
_ggml.ggml_tensor_overhead.argtypes = []
_ggml.ggml_tensor_overhead.restype = ctypes.c_size_t


class GgmlTensor(ctypes.Structure):
    """Mirror of `struct ggml_tensor` (ggml/include/ggml.h of the pinned llama.cpp)."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * 4),
        ("nb", ctypes.c_size_t * 4),
        ("op", ctypes.c_int),
        ("op_params", ctypes.c_int32 * 16),
        ("flags", ctypes.c_int32),
        ("src", ctypes.c_void_p * 10),
        ("view_src", ctypes.c_void_p),
        ("view_offs", ctypes.c_size_t),
        ("data", ctypes.c_void_p),
        ("name", ctypes.c_char * 64),
        ("extra", ctypes.c_void_p),
        ("padding", ctypes.c_char * 8),
    ]


_TENSOR_SIZE = 336
if ctypes.sizeof(GgmlTensor) != _TENSOR_SIZE or _ggml.ggml_tensor_overhead() < _TENSOR_SIZE:
    raise BackendError("ggml_tensor layout", None,
                       f"struct mirror is {ctypes.sizeof(GgmlTensor)} bytes, expected {_TENSOR_SIZE}",
                       hint="this platform or ggml build is not supported for in-place writes")


def _find_op(name: str) -> int:
    for i in range(200):
        op = _ggml.ggml_op_name(i)
        if op is None:
            break
        if op.decode() == name:
            return i
    raise BackendError("ggml_op_name", None, f"op {name} not found")


OP_MUL_MAT = _find_op("MUL_MAT")

EvalCallback = Callable[[int, bool], bool]  # (tensor pointer, ask) -> bool


def tensor_view(ptr: int) -> GgmlTensor:
    """The ggml_tensor at `ptr` (valid only while its owner lives)."""
    return GgmlTensor.from_address(ptr)


def tensor_name(ptr: int) -> str:
    return (_ggml.ggml_get_name(ptr) or b"").decode("utf-8", errors="replace")


def tensor_nbytes(ptr: int) -> int:
    return int(_ggml.ggml_nbytes(ptr))


# Graph-node reads for eval callbacks: they run for every node of every decode, so each is one
# ctypes scalar read at a fixed offset instead of a whole GgmlTensor mirror.
_OFF_OP, _OFF_SRC0, _OFF_NE1 = GgmlTensor.op.offset, GgmlTensor.src.offset, GgmlTensor.ne.offset + 8
_OFF_DATA, _OFF_BUFFER = GgmlTensor.data.offset, GgmlTensor.buffer.offset
_void_at, _int_at, _i64_at = ctypes.c_void_p.from_address, ctypes.c_int.from_address, ctypes.c_int64.from_address


def node_src0(ptr: int) -> int | None:
    """Address of a node's first source tensor (None when it has none)."""
    return _void_at(ptr + _OFF_SRC0).value


def node_op(ptr: int) -> int:
    return _int_at(ptr + _OFF_OP).value


def node_ne1(ptr: int) -> int:
    """A node's second dimension (the token count of a matmul output)."""
    return _i64_at(ptr + _OFF_NE1).value


def node_place(ptr: int) -> tuple[int | None, int | None]:
    """(data address, backend buffer) of a node: together they say which memory it was computed into."""
    return _void_at(ptr + _OFF_DATA).value, _void_at(ptr + _OFF_BUFFER).value


def host_f32_view(ptr: int, shape: tuple[int, int]) -> np.ndarray | None:
    """A numpy view of a contiguous F32 tensor that lives in host memory (None elsewhere, e.g. on a GPU)."""
    t = GgmlTensor.from_address(ptr)
    if not t.data or not t.buffer or t.type != G.F32 or not _ggml.ggml_backend_buffer_is_host(t.buffer):
        return None
    n = shape[0] * shape[1]
    return np.frombuffer((ctypes.c_float * n).from_address(t.data), np.float32).reshape(shape)


def tensor_host_address(ptr: int) -> tuple[int, int] | None:
    """(data address, buffer) of a tensor in host memory; None on a device (GPU) buffer."""
    t = GgmlTensor.from_address(ptr)
    if not t.data or not t.buffer or not _ggml.ggml_backend_buffer_is_host(t.buffer):
        return None
    return int(t.data), int(t.buffer)


def buffer_alignment(buffer: int) -> int:
    return int(_ggml.ggml_backend_buffer_get_alignment(buffer))


def host_bytes(address: int, nbytes: int) -> np.ndarray:
    """A writable uint8 view of `nbytes` of host memory at `address` (valid while its owner lives)."""
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(address))


def tensor_set_raw(ptr: int, address: int, nbytes: int) -> None:
    """ggml_backend_tensor_set from a pre-computed host address (no numpy attribute lookups)."""
    _ggml.ggml_backend_tensor_set(ptr, address, 0, nbytes)


def tensor_set(ptr: int, data: np.ndarray, offset: int = 0) -> None:
    """Copy a contiguous array into a backend tensor (any backend: CPU, GPU)."""
    _ggml.ggml_backend_tensor_set(ptr, data.ctypes.data, offset, data.nbytes)


def tensor_get(ptr: int, out: np.ndarray, offset: int = 0) -> np.ndarray:
    """Copy a backend tensor's bytes into the contiguous array `out` and return it."""
    _ggml.ggml_backend_tensor_get(ptr, out.ctypes.data, offset, out.nbytes)
    return out


def tensor_set_2d(ptr: int, data: np.ndarray, offset: int, row_bytes: int, n_rows: int,
                  stride_tensor: int) -> None:
    """Copy `n_rows` runs of `row_bytes` from contiguous `data` into a tensor, `stride_tensor` apart.

    One call writes a column block of a row-major matrix (a slot of a LoRA bank's B factor).
    """
    _ggml.ggml_backend_tensor_set_2d(ptr, data.ctypes.data, offset, row_bytes, n_rows, stride_tensor, row_bytes)


TILED_ENV = "GGML_CPU_TILED_MM"
# ggml reads GGML_CPU_TILED_MM once, at the first matmul of the process: remember what it saw.
_first_decode_env: str | None = None


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
# Handles
# --------------------------------------------------------------------------------------------

def _address(ptr: Any) -> int:
    """A ctypes pointer's address as an int (0 for NULL)."""
    return int(ctypes.cast(ptr, ctypes.c_void_p).value or 0)


class _Handle:
    """A native pointer with an idempotent close()."""

    _free: Callable[[Any], None]

    def __init__(self, ptr: Any) -> None:
        self._ptr = ptr
        self._lock = threading.Lock()

    @property
    def ptr(self) -> Any:
        if self._ptr is None:
            raise BackendError(type(self).__name__, None, "handle used after close()")
        return self._ptr

    @property
    def closed(self) -> bool:
        return self._ptr is None

    def close(self) -> None:
        with self._lock:
            if self._ptr is not None:
                ptr, self._ptr = self._ptr, None
                type(self)._free(ptr)

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:  # last resort; explicit close() is the contract
        try:
            self.close()
        except Exception:  # noqa: BLE001
            pass


class ModelHandle(_Handle):
    """A loaded `llama_model` plus its vocabulary."""

    _free = staticmethod(C.llama_model_free)

    @classmethod
    def load(cls, path: str, *, n_gpu_layers: int = 0, use_mmap: bool = True, use_mlock: bool = False,
             vocab_only: bool = False, repack: bool = True, devices: Sequence[int] = ()) -> ModelHandle:
        p = C.llama_model_default_params()
        p.n_gpu_layers = n_gpu_layers
        # devices: ggml_backend_dev_t's to offload to (RPC workers, from rpc_devices), NULL-terminated;
        # llama.cpp copies the list during the load
        dev_list = (ctypes.c_void_p * (len(devices) + 1))(*devices, None) if devices else None
        if dev_list is not None:
            p.devices = ctypes.addressof(dev_list)
        # Repacked CPU weights (extra buffer types) compute a token differently depending on how many
        # tokens share the matmul; deterministic serving turns them off at load time.
        p.use_extra_bufts = repack
        if hasattr(p, "use_mmap"):
            p.use_mmap = use_mmap
            p.use_mlock = use_mlock
        elif hasattr(p, "load_mode"):
            # this binding replaced use_mmap/use_mlock with load_mode (0 = mmap, see llama.h)
            p.load_mode = 0 if use_mmap else _load_mode_no_mmap()
        p.vocab_only = vocab_only
        ptr = C.llama_model_load_from_file(os.fsencode(path), p)
        if not ptr:
            raise BackendError("llama_model_load_from_file", None, f"could not load {path}",
                               hint="the log (logger 'loramux.llama') has llama.cpp's reason")
        h = cls(ptr)
        h.vocab = C.llama_model_get_vocab(ptr)
        h.repack = repack
        return h

    @property
    def n_embd(self) -> int:
        return int(C.llama_model_n_embd(self.ptr))

    @property
    def n_layer(self) -> int:
        return int(C.llama_model_n_layer(self.ptr))

    @property
    def n_vocab(self) -> int:
        return int(C.llama_vocab_n_tokens(self.vocab))

    @property
    def n_ctx_train(self) -> int:
        return int(C.llama_model_n_ctx_train(self.ptr))

    def desc(self) -> str:
        buf = ctypes.create_string_buffer(256)
        C.llama_model_desc(self.ptr, buf, 256)
        return buf.value.decode("utf-8", errors="replace")

    def size(self) -> int:
        return int(C.llama_model_size(self.ptr))

    def meta(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(4096)
        n = C.llama_model_meta_val_str(self.ptr, key.encode(), buf, 4096)
        return None if n < 0 else buf.value.decode("utf-8", errors="replace")

    def chat_template(self) -> str | None:
        t = C.llama_model_chat_template(self.ptr, None)
        return t.decode("utf-8", errors="replace") if t else None

    # -- vocabulary --------------------------------------------------------------------------
    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        data = text.encode("utf-8")
        cap = len(data) + 16
        buf = (C.llama_token * cap)()
        n = C.llama_tokenize(self.vocab, data, len(data), buf, cap, add_special, parse_special)
        if n < 0:
            cap = -n
            buf = (C.llama_token * cap)()
            n = C.llama_tokenize(self.vocab, data, len(data), buf, cap, add_special, parse_special)
            if n < 0:
                raise BackendError("llama_tokenize", n)
        return list(buf[:n])

    def token_bytes(self, token: int, special: bool = False) -> bytes:
        buf = ctypes.create_string_buffer(64)
        n = C.llama_token_to_piece(self.vocab, token, buf, 64, 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = C.llama_token_to_piece(self.vocab, token, buf, -n, 0, special)
        return buf.raw[: max(n, 0)]

    def is_eog(self, token: int) -> bool:
        return bool(C.llama_vocab_is_eog(self.vocab, token))

    @property
    def bos(self) -> int:
        return int(C.llama_vocab_bos(self.vocab))

    @property
    def eos(self) -> int:
        return int(C.llama_vocab_eos(self.vocab))

    @property
    def add_bos(self) -> bool:
        return bool(C.llama_vocab_get_add_bos(self.vocab))


def _load_mode_no_mmap() -> int:
    return int(getattr(C, "LLAMA_LOAD_MODE_NONE", 1))


class AdapterHandle(_Handle):
    """A `llama_adapter_lora` loaded against a model."""

    _free = staticmethod(C.llama_adapter_lora_free)

    @classmethod
    def load(cls, model: ModelHandle, path: str) -> AdapterHandle:
        ptr = C.llama_adapter_lora_init(model.ptr, os.fsencode(path))
        if not ptr:
            raise BackendError("llama_adapter_lora_init", None, f"llama.cpp refused {path}",
                               hint="the log (logger 'loramux.llama') has llama.cpp's reason")
        return cls(ptr)

    def alora_invocation_tokens(self) -> list[int]:
        n = int(C.llama_adapter_get_alora_n_invocation_tokens(self.ptr))
        if n == 0:
            return []
        toks = C.llama_adapter_get_alora_invocation_tokens(self.ptr)
        return [int(toks[i]) for i in range(n)]


class ContextHandle(_Handle):
    """A `llama_context`: KV cache, batches, logits, adapter set, control vector, eval callback."""

    _free = staticmethod(C.llama_free)

    @classmethod
    def create(cls, model: ModelHandle, *, n_ctx: int, n_batch: int, n_ubatch: int, n_seq_max: int,
               n_threads: int, n_threads_batch: int, kv_unified: bool = False, flash_attn: bool = False,
               kv_type: str = "f16", callback: EvalCallback | None = None) -> ContextHandle:
        p = C.llama_context_default_params()
        if kv_type not in KV_TYPES:
            raise BackendError("llama_context_params", None, f"unknown KV cache type {kv_type!r}",
                               hint=f"use one of {', '.join(KV_TYPES)}")
        p.type_k = p.type_v = KV_TYPES[kv_type]
        p.n_ctx, p.n_batch, p.n_ubatch, p.n_seq_max = n_ctx, n_batch, n_ubatch, n_seq_max
        p.n_threads, p.n_threads_batch = n_threads, n_threads_batch
        p.kv_unified = kv_unified
        p.flash_attn_type = C.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn else C.LLAMA_FLASH_ATTN_TYPE_DISABLED
        p.no_perf = True
        cb = None
        if callback is not None:
            cb = _make_eval_callback(callback)
            p.cb_eval = cb
            p.cb_eval_user_data = None
        ptr = C.llama_init_from_model(model.ptr, p)
        if not ptr:
            raise BackendError("llama_init_from_model", None, f"could not create a context (n_ctx={n_ctx})",
                               hint="lower n_ctx / n_parallel, or free memory")
        h = cls(ptr)
        h.model = model
        h._cb = cb  # the C side keeps a raw pointer: keep the Python object alive as long as the context
        h.n_ctx = int(C.llama_n_ctx(ptr))
        h.n_vocab = model.n_vocab
        h.n_seq_max = n_seq_max
        h._adapters: tuple[tuple[int, float], ...] = ()
        return h

    def decode(self, batch: Batch) -> None:
        global _first_decode_env
        if _first_decode_env is None:
            _first_decode_env = os.environ.get(TILED_ENV, "")
        rc = C.llama_decode(self.ptr, batch.struct)
        if rc != 0:
            detail = {1: "no KV cache slot for the batch (context full)", 2: "aborted",
                      -1: "invalid batch"}.get(rc, "")
            raise BackendError("llama_decode", rc, detail)

    def logits_row(self, i: int) -> np.ndarray:
        """Copy of the logits of output row `i` of the last batch (-1: the last)."""
        ptr = C.llama_get_logits_ith(self.ptr, i)
        if not ptr:
            raise BackendError("llama_get_logits_ith", None, f"no logits for row {i}")
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy()

    def argmax(self, i: int) -> int:
        """Greedy token of output row `i`, read in place (no copy, no sampler chain).

        Same choice as llama.cpp's greedy sampler: the first index of the maximum logit. The
        sampler builds a candidate array over the whole vocabulary on every token; on a 262k-token
        vocabulary that is the largest per-token cost outside the graph.
        """
        ptr = C.llama_get_logits_ith(self.ptr, i)
        if not ptr:
            raise BackendError("llama_get_logits_ith", None, f"no logits for row {i}")
        row = np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))
        tok = int(row.argmax())
        if not math.isfinite(row[tok]):  # argmax picks the first NaN, or +Inf: O(1) to see either
            raise FloatingPointError(f"the logits of row {i} are not finite (NaN or +Inf at token {tok})")
        return tok

    def logits_finite(self, i: int) -> bool:
        """Whether output row `i` has no NaN and no +Inf (one pass: max propagates NaN)."""
        ptr = C.llama_get_logits_ith(self.ptr, i)
        if not ptr:
            raise BackendError("llama_get_logits_ith", None, f"no logits for row {i}")
        return math.isfinite(float(np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).max()))

    def set_adapters(self, adapters: Sequence[AdapterHandle], scales: Sequence[float]) -> bool:
        """Set the context's adapter set (llama.cpp re-reserves the graph on the next decode).

        Returns whether the set changed (False: the same adapters and scales were already set)."""
        key = tuple((_address(a.ptr), float(s)) for a, s in zip(adapters, scales))
        if key == self._adapters:
            return False
        n = len(adapters)
        arr = (C.llama_adapter_lora_p_ctypes * max(n, 1))(*[a.ptr for a in adapters])
        sc = (ctypes.c_float * max(n, 1))(*scales)
        rc = C.llama_set_adapters_lora(self.ptr, arr if n else None, n, sc if n else None)
        if rc != 0:
            raise BackendError("llama_set_adapters_lora", rc)
        self._adapters = key
        return True

    def uses_adapter(self, adapter: AdapterHandle) -> bool:
        """Is this adapter in the context's current set? (A closed handle never is.)"""
        return not adapter.closed and any(p == _address(adapter.ptr) for p, _ in self._adapters)

    def set_control_vector(self, data: np.ndarray | None, n_embd: int, il_start: int, il_end: int) -> None:
        """Apply a control vector (data: n_layer × n_embd, layers 1..n_layer) or clear it (None)."""
        if data is None:
            rc = C.llama_set_adapter_cvec(self.ptr, None, 0, n_embd, 0, 0)
        else:
            flat = np.ascontiguousarray(data, dtype=np.float32).ravel()
            self._cvec = flat  # keep alive until replaced
            rc = C.llama_set_adapter_cvec(self.ptr, flat.ctypes.data_as(ctypes.POINTER(ctypes.c_float)),
                                          flat.size, n_embd, il_start, il_end)
        if rc != 0:
            raise BackendError("llama_set_adapter_cvec", rc)

    def memory_seq_rm(self, seq_id: int, p0: int = -1, p1: int = -1) -> bool:
        mem = C.llama_get_memory(self.ptr)
        return bool(C.llama_memory_seq_rm(mem, seq_id, p0, p1))

    def memory_clear(self) -> None:
        C.llama_memory_clear(C.llama_get_memory(self.ptr), True)


# The KV cache types llama.cpp accepts here, by the name `kv_type` takes.
KV_TYPES = {"f32": G.F32, "f16": G.F16, "bf16": G.BF16, "q8_0": G.Q8_0}


def _make_eval_callback(fn: EvalCallback) -> Any:
    if isinstance(fn, MatmulStops):
        return C.ggml_backend_sched_eval_callback(_stops_trampoline(fn))

    def trampoline(t: int, ask: bool, _user: Any) -> bool:
        # An exception in an ask=False call would silently truncate the graph: never let one out.
        try:
            return bool(fn(t, ask))
        except Exception:  # noqa: BLE001
            log.exception("eval callback failed")
            return not ask
    return C.ggml_backend_sched_eval_callback(trampoline)


class Batch:
    """A `llama_batch` over numpy buffers we own: filling it is vectorised, not a per-token loop."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.token = np.zeros(capacity, dtype=np.int32)
        self.pos = np.zeros(capacity, dtype=np.int32)
        self.n_seq_id = np.ones(capacity, dtype=np.int32)
        self.seq = np.zeros(capacity, dtype=np.int32)
        # seq_id[i] points at seq[i]: one sequence per token.
        self.seq_ptrs = (self.seq.ctypes.data + 4 * np.arange(capacity, dtype=np.uint64)).astype(np.uint64)
        self.logits = np.zeros(capacity, dtype=np.int8)
        self.struct = C.llama_batch()
        self.struct.token = self.token.ctypes.data_as(ctypes.POINTER(C.llama_token))
        self.struct.embd = None
        self.struct.pos = self.pos.ctypes.data_as(ctypes.POINTER(C.llama_pos))
        self.struct.n_seq_id = self.n_seq_id.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        self.struct.seq_id = ctypes.cast(self.seq_ptrs.ctypes.data, ctypes.POINTER(ctypes.POINTER(C.llama_seq_id)))
        self.struct.logits = self.logits.ctypes.data_as(ctypes.POINTER(ctypes.c_int8))
        self.n = 0

    def clear(self) -> None:
        self.n = 0
        self.struct.n_tokens = 0

    def add(self, tokens: Sequence[int] | np.ndarray, pos0: int, seq_id: int, logits: bool | Sequence[bool]) -> None:
        """Append tokens of one sequence at positions pos0.. ; `logits` per token or for all."""
        k = len(tokens)
        if self.n + k > self.capacity:
            raise BackendError("llama_batch", None, f"batch capacity {self.capacity} exceeded")
        s = slice(self.n, self.n + k)
        self.token[s] = tokens
        self.pos[s] = np.arange(pos0, pos0 + k, dtype=np.int32)
        self.seq[s] = seq_id
        self.logits[s] = np.asarray(logits, dtype=np.int8) if not isinstance(logits, bool) else int(logits)
        self.n += k
        self.struct.n_tokens = self.n


# --------------------------------------------------------------------------------------------
# Samplers
# --------------------------------------------------------------------------------------------

class SamplerHandle(_Handle):
    """llama.cpp's sampler chain: penalties → top_k → top_p → min_p → temperature → dist (or greedy)."""

    _free = staticmethod(C.llama_sampler_free)

    @classmethod
    def chain(cls, model: ModelHandle, *, temperature: float, top_k: int, top_p: float, min_p: float,
              repeat_penalty: float, repeat_last_n: int, frequency_penalty: float, presence_penalty: float,
              seed: int) -> SamplerHandle:
        ch = C.llama_sampler_chain_init(C.llama_sampler_chain_default_params())
        h = cls(ch)
        add = lambda s: C.llama_sampler_chain_add(ch, s)  # noqa: E731 - the chain owns each sampler
        if repeat_penalty != 1.0 or frequency_penalty or presence_penalty:
            add(_penalties(model, repeat_last_n, repeat_penalty, frequency_penalty, presence_penalty))
        if temperature <= 0:
            add(C.llama_sampler_init_greedy())
            return h
        if top_k > 0:
            add(C.llama_sampler_init_top_k(top_k))
        if top_p < 1.0:
            add(C.llama_sampler_init_top_p(top_p, 1))
        if min_p > 0:
            add(C.llama_sampler_init_min_p(min_p, 1))
        add(C.llama_sampler_init_temp(temperature))
        add(C.llama_sampler_init_dist(seed & 0xFFFFFFFF))
        return h

    def sample(self, ctx: ContextHandle, idx: int) -> int:
        return int(C.llama_sampler_sample(self.ptr, ctx.ptr, idx))

    def accept(self, token: int) -> None:
        C.llama_sampler_accept(self.ptr, token)


def _penalties(model: ModelHandle, last_n: int, repeat: float, freq: float, present: float) -> Any:
    argtypes = getattr(C.llama_sampler_init_penalties, "argtypes", None) or []
    if len(argtypes) == 5:  # some bindings take n_vocab first
        return C.llama_sampler_init_penalties(model.n_vocab, last_n, repeat, freq, present)
    return C.llama_sampler_init_penalties(last_n, repeat, freq, present)


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


# --------------------------------------------------------------------------------------------
# Selective eval callbacks (the slot bank's per-token masks)
# --------------------------------------------------------------------------------------------

class MatmulStops:
    """An eval callback that stops only at MUL_MAT nodes whose first source is one of `src0`.

    ggml asks the callback about every node of every graph (about 1,500 per decode of Gemma 3
    270M), so the ask answer is what the eval callback costs per step. A context created with a
    `MatmulStops` answers it in one Python frame with two scalar reads (see `_stops_trampoline`)
    instead of going through a generic callback; `on_node(t)` runs for each selected node after it
    was computed and must not raise (an error there would cut the graph short: it is logged and the
    node is left as computed, so the caller must check its own bookkeeping after the decode).
    Calling the object directly behaves like any `EvalCallback` (for tests and other contexts).
    `src0` may be replaced between decodes (an empty set: no stops at all, the graph runs in one go).
    """

    __slots__ = ("on_node", "src0")

    def __init__(self, src0: Iterable[int], on_node: Callable[[int], None]) -> None:
        self.src0 = frozenset(src0)
        self.on_node = on_node

    def __call__(self, t: int, ask: bool) -> bool:
        if ask:
            return _void_at(t + _OFF_SRC0).value in self.src0 and _int_at(t + _OFF_OP).value == OP_MUL_MAT
        self.on_node(t)
        return True


def _stops_trampoline(stops: MatmulStops) -> Callable[[int, bool, Any], bool]:
    on_node, mul_mat = stops.on_node, OP_MUL_MAT
    void_at, int_at, off_src0, off_op = _void_at, _int_at, _OFF_SRC0, _OFF_OP

    def trampoline(t: int, ask: bool, _user: Any) -> bool:
        try:
            if ask:  # the common case: one set lookup; the op is read only for a selected source
                return void_at(t + off_src0).value in stops.src0 and int_at(t + off_op).value == mul_mat
            on_node(t)
        except Exception:  # noqa: BLE001 - never truncate the graph (see MatmulStops)
            log.exception("eval callback failed")
        return not ask  # after a node: go on; a failed ask: do not stop there
    return trampoline


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
_ggml.ggml_set_abort_callback.argtypes = [_AbortCallback]
_ggml.ggml_set_abort_callback.restype = ctypes.c_void_p
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
        _ggml.ggml_set_abort_callback(_abort_cb)


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


# --------------------------------------------------------------------------------------------
# Scoring and n > 1: sharing a prompt's KV between sequences
# --------------------------------------------------------------------------------------------

def memory_seq_cp(ctx: ContextHandle, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
    """Make sequence `dst` share the KV cells of `src` at positions [p0, p1) (no data is copied in a
    unified cache: the cells gain `dst`'s id). Only for a unified KV cache: across per-sequence streams
    llama.cpp supports whole-stream copies only."""
    C.llama_memory_seq_cp(C.llama_get_memory(ctx.ptr), src, dst, p0, p1)


def logits_view(ctx: ContextHandle, i: int) -> np.ndarray:
    """The logits of output row `i` of the last batch, in place (no copy): valid until the next decode."""
    ptr = C.llama_get_logits_ith(ctx.ptr, i)
    if not ptr:
        raise BackendError("llama_get_logits_ith", None, f"no logits for row {i}")
    return np.ctypeslib.as_array(ptr, shape=(ctx.n_vocab,))


# --------------------------------------------------------------------------------------------
# Grammar-constrained sampling (structured output, tool calls)
# --------------------------------------------------------------------------------------------

GREEDY_SCAN = 64  # greedy: allowed-token checks before a full grammar pass over the vocabulary
_TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)], align=True)
_grammar_log = threading.local()  # llama.cpp's parse messages, collected on the creating thread


def _grammar_log_hook(level: int, text: bytes) -> None:
    lines = getattr(_grammar_log, "lines", None)
    if lines is not None and level in (3, 4, 5):
        lines.append(text.decode("utf-8", errors="replace").rstrip("\n"))


class GrammarHandle(_Handle):
    """One request's GBNF grammar sampler (`llama_sampler_init_grammar`), used the lazy way llama-server's
    common sampler uses it: the unconstrained choice is checked against the grammar first (one candidate),
    and only a rejected choice pays for a pass of the grammar over the whole vocabulary."""

    _free = staticmethod(C.llama_sampler_free)
    #: False: mask the whole vocabulary for every token (the reference the lazy checks must equal)
    lazy = True

    @classmethod
    def create(cls, model: ModelHandle, gbnf: str, root: str = "root") -> GrammarHandle:
        """Parse `gbnf`; a grammar llama.cpp refuses raises BackendError with llama.cpp's own messages."""
        _grammar_log.lines = []
        try:
            ptr = C.llama_sampler_init_grammar(model.vocab, gbnf.encode("utf-8"), root.encode("utf-8"))
            lines = list(_grammar_log.lines)
        finally:
            _grammar_log.lines = None
        if not ptr:
            raise BackendError("llama_sampler_init_grammar", None,
                               " ".join(" ".join(lines).split()) or "the grammar does not parse")
        return cls(ptr, model.n_vocab)

    def __init__(self, ptr: Any, n_vocab: int) -> None:
        super().__init__(ptr)
        self.n_vocab = n_vocab
        self._one = np.zeros(1, dtype=_TOKEN_DATA)
        self._all: np.ndarray | None = None  # the whole-vocabulary candidates, allocated on first rejection

    def _apply(self, smpl: Any, data: np.ndarray) -> int:
        arr = C.llama_token_data_array(data.ctypes.data_as(ctypes.POINTER(C.llama_token_data)), len(data), -1, False)
        C.llama_sampler_apply(smpl, ctypes.byref(arr))
        return int(arr.selected)

    def allows(self, token: int) -> bool:
        """Whether the grammar, in its current state, accepts `token` next (a one-candidate check)."""
        one = self._one
        one["id"], one["logit"], one["p"] = token, 0.0, 0.0
        self._apply(self.ptr, one)
        return bool(np.isfinite(one["logit"][0]))

    def _candidates(self, ctx: ContextHandle, idx: int) -> np.ndarray:
        ptr = C.llama_get_logits_ith(ctx.ptr, idx)
        if not ptr:
            raise BackendError("llama_get_logits_ith", None, f"no logits for row {idx}")
        if self._all is None:
            self._all = np.zeros(self.n_vocab, dtype=_TOKEN_DATA)
        a = self._all
        a["id"] = np.arange(self.n_vocab, dtype=np.int32)
        a["logit"] = np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))
        a["p"] = 0.0
        return a

    def pick(self, ctx: ContextHandle, idx: int, chain: SamplerHandle | None, ban: np.ndarray | None = None) -> int:
        """The next token under the grammar: greedy (`chain` None) or through the chain, without accepting it.

        `ban` (a boolean mask over the vocabulary) removes tokens on top of the grammar."""
        if chain is None:
            tok = ctx.argmax(idx)
        else:
            cand = self._candidates(ctx, idx)
            tok = int(cand["id"][self._apply(chain.ptr, cand)])
        if self.lazy and (ban is None or not ban[tok]) and self.allows(tok):
            return tok
        if chain is None and self.lazy:  # greedy: the best allowed token is nearly always among the best few
            best = self._best_allowed(ctx, idx, ban, GREEDY_SCAN)
            if best is not None:
                return best
        cand = self._candidates(ctx, idx)
        self._apply(self.ptr, cand)  # rejected: mask the whole vocabulary (in id order), then choose again
        if ban is not None:
            cand["logit"][ban] = -np.inf
        if not np.isfinite(cand["logit"]).any():
            raise BackendError("llama_sampler_apply", None, "the grammar allows no token here (a dead end)")
        if chain is None:
            return int(cand["logit"].argmax())
        return int(cand["id"][self._apply(chain.ptr, cand)])

    def _best_allowed(self, ctx: ContextHandle, idx: int, ban: np.ndarray | None, k: int) -> int | None:
        """The highest-logit token the grammar allows among the `k` best (ties: the lowest id, as argmax over
        the masked vocabulary would pick), or None to fall back to the full pass."""
        ptr = C.llama_get_logits_ith(ctx.ptr, idx)
        if not ptr:
            raise BackendError("llama_get_logits_ith", None, f"no logits for row {idx}")
        row = np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))
        top = np.sort(np.argpartition(row, -k)[-k:])
        kth = row[top].min()
        for t in top[np.argsort(-row[top], kind="stable")]:
            if row[t] == kth and (row > kth).sum() + (row == kth).sum() > k:
                return None  # ties at the edge of the window: a token outside it could rank the same
            if (ban is None or not ban[t]) and self.allows(int(t)):
                return int(t)
        return None

    def accept(self, token: int) -> None:
        """Advance the grammar by a token it allows (never pass one `allows` refused: llama.cpp aborts)."""
        C.llama_sampler_accept(self.ptr, token)


def sampler_accept(chain: SamplerHandle, token: int) -> None:
    """Record a token chosen outside `SamplerHandle.sample` (penalty history)."""
    C.llama_sampler_accept(chain.ptr, token)


# llama-cpp-python's maintained port of llama.cpp's JSON-schema → GBNF converter (pure Python, shipped with
# the binding), re-exported so that the engine reaches the binding through this module only.
from llama_cpp.llama_grammar import JSON_GBNF as JSON_GBNF  # noqa: E402
from llama_cpp.llama_grammar import RESERVED_NAMES as _GRAMMAR_RESERVED  # noqa: E402
from llama_cpp.llama_grammar import SchemaConverter as SchemaConverter  # noqa: E402

GRAMMAR_RESERVED_NAMES = frozenset(_GRAMMAR_RESERVED)  # rule names the converter keeps for itself
