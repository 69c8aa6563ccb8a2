"""Owned llama.cpp objects: the idempotent-close `Handle` base, the model, adapter and context handles,
the KV cache types, the eval-callback wrapper a context keeps referenced, the numpy-backed `Batch`,
and the per-sequence KV and logits helpers used by scoring and n > 1.
"""

from __future__ import annotations

import ctypes
import math
import os
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .. import ggml_types as G
from ..errors import BackendError
from .callbacks import MatmulStops, stops_trampoline
from .lib import C, log, note_first_decode, reserved_graph_nodes, set_sched_eval_callback
from .tensors import EvalCallback

# --------------------------------------------------------------------------------------------
# Handles
# --------------------------------------------------------------------------------------------

# llama.cpp keeps every adapter of a model in one unordered_set (`llama_model::loras`): an adapter load
# inserts into it, a free erases, and a context reserving its graph iterates it (`graph_max_nodes`, at
# creation and on the first decode after its adapter set or control vector changed). Everything else a
# load does touches only the new adapter, so loads may run on any thread as long as these three never
# overlap: they take this lock, and nothing else does. An engine thread decoding a fixed adapter set
# never waits on it.
_MODEL_ADAPTERS = threading.RLock()


def _address(ptr: Any) -> int:
    """A ctypes pointer's address as an int (0 for NULL)."""
    return int(ctypes.cast(ptr, ctypes.c_void_p).value or 0)


class Handle:
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


class ModelHandle(Handle):
    """A loaded `llama_model` plus its vocabulary, and the adapters loaded against it (freed with it)."""

    _free = staticmethod(C.llama_model_free)

    def __init__(self, ptr: Any) -> None:
        super().__init__(ptr)
        # An adapter lives in the model's set: freeing it after the model crashes the process (llama.cpp
        # frees the set with the model), and one a caller still holds is freed by its own __del__, late.
        self.adapters: weakref.WeakSet[AdapterHandle] = weakref.WeakSet()

    def close(self) -> None:
        """Free every adapter still loaded against the model (they read "closed" from now on), then it."""
        with _MODEL_ADAPTERS:
            for adapter in list(self.adapters):
                adapter.close()
            super().close()

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

    @property
    def fim_tokens(self) -> dict[str, int | None]:
        """The vocabulary's fill-in-the-middle tokens ("pre", "suf", "mid", "rep", "sep"); None where absent."""
        out: dict[str, int | None] = {}
        for name in ("pre", "suf", "mid", "rep", "sep"):
            t = int(getattr(C, f"llama_vocab_fim_{name}")(self.vocab))
            out[name] = t if t >= 0 else None  # LLAMA_TOKEN_NULL is -1
        return out


def _load_mode_no_mmap() -> int:
    return int(getattr(C, "LLAMA_LOAD_MODE_NONE", 1))


class AdapterHandle(Handle):
    """A `llama_adapter_lora` loaded against a model."""

    _free = staticmethod(C.llama_adapter_lora_free)

    @classmethod
    def load(cls, model: ModelHandle, path: str) -> AdapterHandle:
        """Load an adapter file into llama.cpp (any thread: see `_MODEL_ADAPTERS`)."""
        with _MODEL_ADAPTERS:
            ptr = C.llama_adapter_lora_init(model.ptr, os.fsencode(path))
            if ptr:
                handle = cls(ptr)
                model.adapters.add(handle)  # in the lock: a model closing frees it before itself
        if not ptr:
            raise BackendError("llama_adapter_lora_init", None, f"llama.cpp refused {path}",
                               hint="the log (logger 'loramux.llama') has llama.cpp's reason")
        return handle

    def close(self, wait: bool = True) -> bool:
        """Free the adapter (idempotent). `wait=False`: only if no load holds the model's adapter set now
        (`_MODEL_ADAPTERS`); returns whether it is freed, so an engine thread can try again later."""
        if not _MODEL_ADAPTERS.acquire(blocking=wait):
            return False
        try:  # the free erases it from the model's set
            super().close()
        finally:
            _MODEL_ADAPTERS.release()
        return True

    def alora_invocation_tokens(self) -> list[int]:
        n = int(C.llama_adapter_get_alora_n_invocation_tokens(self.ptr))
        if n == 0:
            return []
        toks = C.llama_adapter_get_alora_invocation_tokens(self.ptr)
        return [int(toks[i]) for i in range(n)]


class ContextHandle(Handle):
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
        with _MODEL_ADAPTERS:  # a new context reserves its graph, sized for every adapter of the model
            ptr = C.llama_init_from_model(model.ptr, p)
        if not ptr:
            raise BackendError("llama_init_from_model", None, f"could not create a context (n_ctx={n_ctx})",
                               hint="lower n_ctx / n_parallel, or free memory")
        h = cls(ptr)
        h.model = model
        h._cb = cb  # the C side keeps a raw pointer: keep the Python object alive as long as the context
        h._cb_on = cb is not None  # what this handle last gave the scheduler (see decode)
        h.n_ctx = int(C.llama_n_ctx(ptr))
        h.n_vocab = model.n_vocab
        h.n_seq_max = n_seq_max
        h._adapters: tuple[tuple[int, float], ...] = ()
        h._reserve_due = False  # llama.cpp re-reserves the graph at the next decode (adapter set or cvec changed)
        return h

    def decode(self, batch: Batch, eval_callback: bool = True) -> None:
        """Decode the batch. `eval_callback=False`: without the context's eval callback, when it has one.

        ggml asks the callback about every graph node (about 1,450 ctypes calls a decode of Gemma 3
        270M, ~3 % of it), so a decode that needs no stop (the slot bank's context decoding one adapter
        set natively, with no KV guard) takes it off its scheduler. llama.cpp puts `cparams.cb_eval`
        back itself whenever it builds a graph (a new shape, an adapter-set change), so the worst a
        missed detach costs is the asks; never the other way round: a decode that needs the callback
        (the default) always has it, given back here before llama_decode if this handle took it away.
        """
        note_first_decode()
        if self._cb is not None and (self._cb_on != eval_callback or not eval_callback):
            # detach on every such decode: a graph build in between may have put it back
            if set_sched_eval_callback(self.ptr, self._cb if eval_callback else None):
                self._cb_on = eval_callback
        if self._reserve_due:
            with _MODEL_ADAPTERS:
                rc = C.llama_decode(self.ptr, batch.struct)
                self._reserve_due = rc != 0  # a failed decode may not have reserved yet
        else:
            rc = C.llama_decode(self.ptr, batch.struct)
        if rc != 0:
            detail = {1: "no KV cache slot for the batch (context full)", 2: "aborted",
                      -1: "invalid batch"}.get(rc, "")
            raise BackendError("llama_decode", rc, detail)

    def graph_nodes(self) -> list[int] | None:
        """The graph nodes of a one-token decode with this context's adapters, built but not computed;
        None where llama.cpp offers no way to (then decode with an eval callback to see them). Resets the
        context's scheduler: for a context made to look at its graph (adapter discovery)."""
        return reserved_graph_nodes(self.ptr)

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
        self._reserve_due = True
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
        self._reserve_due = True
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
        return C.ggml_backend_sched_eval_callback(stops_trampoline(fn))

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


__all__ = ["KV_TYPES", "AdapterHandle", "Batch", "ContextHandle", "Handle", "ModelHandle", "logits_view",
           "memory_seq_cp"]
