"""LoRA adapters: validated load, identity, and in-place factor writes and reads.

An adapter's factor tensors live where llama.cpp allocated them; the compute graph points at them.
We find them once per adapter (a one-token decode through `cb_eval` on a short-lived context with
only this adapter active), check what we found against the file, and from then on write and read
them directly with `ggml_backend_tensor_set/get`: no re-parse, no re-allocation, no graph rebuild.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from . import _native as N
from .errors import AdapterError, BackendError, FactorError
from .gguf_io import (
    LORA_A,
    LORA_B,
    AdapterFileInfo,
    read_adapter_factors,
    sha256_file,
    validate_adapter,
    write_adapter,
)
from .model import Context, ContextOptions, Model

_uid = itertools.count(1)
_NP = {0: np.float32, 1: np.float16}
_TYPE_NAME = {0: "F32", 1: "F16", 30: "BF16"}


@dataclass
class _Factor:
    a: int  # ggml_tensor* of lora_a
    b: int
    type: int  # ggml type id of both
    a_shape: tuple[int, int]  # numpy (r, in)
    b_shape: tuple[int, int]  # numpy (out, r)


def _to_bf16_bits(x: np.ndarray) -> np.ndarray:
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def _from_bf16_bits(u: np.ndarray) -> np.ndarray:
    return (u.astype(np.uint32) << 16).view(np.float32)


def _encode(x: np.ndarray, ggml_type: int) -> np.ndarray:
    """An array in the tensor's own storage format (what tensor_set copies)."""
    if ggml_type == 30:
        return _to_bf16_bits(x)
    return np.ascontiguousarray(x, dtype=_NP[ggml_type])


def _decode(raw: np.ndarray, ggml_type: int) -> np.ndarray:
    return _from_bf16_bits(raw) if ggml_type == 30 else raw.astype(np.float32)


def _as_float(x: Any) -> np.ndarray:
    """Accept float32/float16/bfloat16 (torch or ml_dtypes) arrays; return float32."""
    if hasattr(x, "detach"):  # torch tensor: bf16 has no numpy dtype, go through float32
        x = x.detach().float().cpu().numpy()
    arr = np.asarray(x)
    if arr.dtype.name == "bfloat16":
        arr = arr.astype(np.float32)
    if arr.dtype.kind != "f":
        raise TypeError(f"factors must be floating point, got {arr.dtype}")
    return arr.astype(np.float32, copy=False)


class LoRAAdapter:
    """A LoRA adapter loaded against the base model.

    Attributes: ``name``, ``path``, ``rank``, ``alpha``, ``targets`` (base tensor names),
    ``dtype``, ``size`` (bytes), ``invocation_tokens`` (aLoRA), ``version`` (bumped by every write).
    """

    def __init__(self, model: Model, path: str | os.PathLike[str], name: str,
                 run: Callable[[Callable[[], Any]], Any] | None = None, *, source: str | None = None,
                 info: AdapterFileInfo | None = None) -> None:
        self.info = info or validate_adapter(path, model.architecture, model.tensor_shapes)
        # Read the factors once: for the NaN/Inf check now and the discovery self-check below.
        file_factors = read_adapter_factors(path)
        bad = [t for t, (a, b) in file_factors.items() if not (np.isfinite(a).all() and np.isfinite(b).all())]
        if bad:
            raise AdapterError(str(path), "cannot be used",
                               problems=[f"{len(bad)} factor pairs contain NaN or Inf, e.g. {', '.join(bad[:3])}"])
        self.model = model
        self.name = name
        self.path = Path(path)
        self.source = source or str(path)
        self.uid = next(_uid)
        self.version = 0
        self._run = run or (lambda fn: fn())
        self._lock = threading.RLock()
        self._factors: dict[str, _Factor] | None = None
        self._sha: str | None = None
        self.handle = N.AdapterHandle.load(model.handle, str(self.path))
        try:
            tokens = self.handle.alora_invocation_tokens()
            self.invocation_tokens: tuple[int, ...] = tuple(tokens) or self.info.invocation_tokens
            self._discover(file_factors)
        except BaseException:
            self.handle.close()
            raise

    # -- info --------------------------------------------------------------------------------
    rank = property(lambda self: self.info.rank)
    alpha = property(lambda self: self.info.alpha)
    targets = property(lambda self: self.info.targets)
    dtype = property(lambda self: self.info.dtype)
    size = property(lambda self: self.info.size)

    @property
    def sha256(self) -> str:
        """sha256 of the file as loaded (computed on first use)."""
        if self._sha is None:
            self._sha = sha256_file(self.path) if self.path.exists() else ""
        return self._sha

    @property
    def is_alora(self) -> bool:
        return bool(self.invocation_tokens)

    @property
    def scaling(self) -> float:
        """alpha / rank, the factor llama.cpp applies on top of the scale (1 when alpha is 0)."""
        return self.alpha / self.rank if self.alpha else 1.0

    def describe(self) -> dict[str, Any]:
        """Plain-dict summary (for the CLI, the server and logs)."""
        return {"name": self.name, "path": str(self.path), "source": self.source, "rank": self.rank,
                "alpha": self.alpha, "dtype": self.dtype, "n_targets": len(self.targets), "size": self.size,
                "invocation_tokens": list(self.invocation_tokens), "version": self.version}

    def __repr__(self) -> str:
        return f"LoRAAdapter({self.name!r}, rank={self.rank}, alpha={self.alpha}, targets={len(self.targets)})"

    # -- discovery ---------------------------------------------------------------------------
    def _discover(self, file_factors: dict[str, tuple[np.ndarray, np.ndarray]]) -> None:
        found: dict[str, int] = {}

        def cb(t: int, ask: bool) -> bool:
            if ask:
                node = N.tensor_view(t)
                for s in node.src:
                    if s:
                        nm = N.tensor_name(s)
                        if nm.endswith((LORA_A, LORA_B)):
                            found.setdefault(nm, s)
            return False  # never split the graph; the ask pass sees every node

        # One thread: a one-token decode gains nothing from more, and waiting on busy cores costs a lot.
        ctx = Context(self.model, ContextOptions(n_ctx=64, n_batch=8, n_ubatch=8, n_seq_max=1, n_threads=1),
                      callback=cb)
        try:
            ctx.handle.set_adapters([self.handle], [1.0])
            ctx.prefill(0, [self.model.handle.bos if self.model.handle.bos >= 0 else 0])
        finally:
            ctx.close()
        self._factors = self._check_discovered(found, file_factors)

    def _check_discovered(self, found: dict[str, int],
                          file_factors: dict[str, tuple[np.ndarray, np.ndarray]]) -> dict[str, _Factor]:
        problems = []
        want = {t + s for t in self.targets for s in (LORA_A, LORA_B)}
        missing = sorted(want - set(found))
        if missing:
            problems.append(f"{len(missing)} factor tensors not found in the compute graph, e.g. {missing[:3]}")
        factors: dict[str, _Factor] = {}
        for t in self.targets if not missing else ():
            a, b = found[t + LORA_A], found[t + LORA_B]
            va, vb = N.tensor_view(a), N.tensor_view(b)
            a_shape, b_shape = self.info.shapes[t]
            if tuple(va.ne[:2]) != tuple(reversed(a_shape)) or tuple(vb.ne[:2]) != tuple(reversed(b_shape)):
                problems.append(f"{t}: graph tensor shapes {tuple(va.ne[:2])}/{tuple(vb.ne[:2])} differ from the file")
                continue
            if va.type not in _TYPE_NAME or va.type != vb.type:
                problems.append(f"{t}: unexpected tensor types {va.type}/{vb.type}")
                continue
            esize = N.GGML_TYPE_SIZE[va.type]
            if N.tensor_nbytes(a) != esize * a_shape[0] * a_shape[1] or N.tensor_nbytes(b) != esize * b_shape[0] * b_shape[1]:
                problems.append(f"{t}: byte sizes differ from the shapes (ggml_tensor layout changed?)")
                continue
            f = _Factor(a, b, va.type, a_shape, b_shape)
            ra, rb = self._read(f)
            fa, fb = file_factors[t]
            if not (np.array_equal(ra, fa) and np.array_equal(rb, fb)):
                problems.append(f"{t}: live tensor contents differ from the file")
                continue
            factors[t] = f
        if problems:
            raise BackendError("adapter tensor discovery", None,
                               f"in-place access to {self.path} failed its self-check: " + "; ".join(problems[:5]),
                               hint="this llama.cpp build is not the one loramux was made for; "
                                    f"pip install llama-cpp-python=={N.PINNED_VERSION}")
        return factors

    def _read(self, f: _Factor) -> tuple[np.ndarray, np.ndarray]:
        store = np.uint16 if f.type == 30 else _NP[f.type]
        ra = N.tensor_get(f.a, np.empty(f.a_shape, dtype=store))
        rb = N.tensor_get(f.b, np.empty(f.b_shape, dtype=store))
        return _decode(ra, f.type), _decode(rb, f.type)

    # -- in-place factors --------------------------------------------------------------------
    def factor_names(self) -> list[str]:
        """Base tensor names this adapter covers, in file order."""
        return list(self.targets)

    @property
    def n_factors(self) -> int:
        return len(self.targets)

    def get_factors(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """Read (A (r, in), B (out, r)) back from the live tensors, as float32."""
        f = self._factor(name)
        return self._run(lambda: self._read(f))

    def set_factors(self, name: str, a: Any, b: Any) -> None:
        """Write one factor pair in place (A (r, in), B (out, r)); seen by every context at once."""
        self.set_factors_multi({name: (a, b)})

    def set_factors_multi(self, factors: Mapping[str, tuple[Any, Any]]) -> None:
        """Write several factor pairs: all are validated first, then all are written (all-or-nothing)."""
        encoded = self._validate(factors)

        def write() -> None:
            with self._lock:
                self._check_open()
                for f, ea, eb in encoded:
                    N.tensor_set(f.a, ea)
                    N.tensor_set(f.b, eb)
                self.version += 1
        self._run(write)

    def _validate(self, factors: Mapping[str, tuple[Any, Any]]) -> list[tuple[_Factor, np.ndarray, np.ndarray]]:
        problems, out = [], []
        for name, pair in factors.items():
            if self._factors is None or name not in self._factors:
                problems.append(f"{name}: not a factor of this adapter (see factor_names())")
                continue
            f = self._factors[name]
            try:
                a, b = (_as_float(x) for x in pair)
            except (TypeError, ValueError) as e:
                problems.append(f"{name}: {e}")
                continue
            if a.shape != f.a_shape or b.shape != f.b_shape:
                hint = ""
                if a.ndim == 2 and b.ndim == 2 and (a.shape[0] != f.a_shape[0] or b.shape[1] != f.b_shape[1]):
                    hint = f" (rank is fixed at {self.rank}: a different rank is a new adapter)"
                problems.append(f"{name}: got A{a.shape} B{b.shape}, expected A{f.a_shape} B{f.b_shape}{hint}")
                continue
            if not (np.isfinite(a).all() and np.isfinite(b).all()):
                problems.append(f"{name}: factors contain NaN or Inf")
                continue
            out.append((f, _encode(a, f.type), _encode(b, f.type)))
        if problems:
            raise FactorError(self.name, "factors refused, nothing written", problems=problems)
        return out

    def _factor(self, name: str) -> _Factor:
        self._check_open()
        if self._factors is None or name not in self._factors:
            raise FactorError(self.name, f"no factor named {name!r}", factor=name,
                              problems=[f"known factors start with {self.targets[:3]}"])
        return self._factors[name]

    def _check_open(self) -> None:
        if self.handle.closed:
            raise FactorError(self.name, "the adapter was unloaded")

    def all_factors(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """Every factor pair read back from the live tensors."""
        assert self._factors is not None
        facs = self._factors
        return self._run(lambda: {n: self._read(f) for n, f in facs.items()})

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the current (live) factors to an adapter GGUF that loads anywhere llama.cpp does."""
        dtype = {"F32": "f32", "F16": "f16", "BF16": "bf16"}.get(self.dtype, "f32")
        return write_adapter(path, self.model.architecture, self.all_factors(), self.alpha, dtype=dtype,
                             invocation_tokens=list(self.invocation_tokens) or None, name=self.name)

    def close(self) -> None:
        """Free the native adapter (only once no context uses it; the registry sees to that)."""
        with self._lock:
            self.handle.close()
