"""LoRA adapters: validated load, identity, file info, tensor discovery and factor reads.

An adapter's factor tensors live where llama.cpp allocated them; the compute graph points at them.
We find them once per adapter (the graph of a one-token decode, built but not computed, on the model's
kept probe context with only this adapter active: model.GraphProbe), check what we found against the
file, and from then on read them directly with `ggml_backend_tensor_get`. Writes belong to the
adapter's `FactorWriter` (factor_writer.py: staging, one lock, the hop between decodes); `set_factors*`
and `edit()` here hand over to it.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np

from .. import _native as N
from ..errors import AdapterError, BackendError, FactorError
from ..ggml_types import ELEMENT_SIZE, FLOAT_NAMES, STORAGE_DTYPE, decode
from ..gguf_io import (
    LORA_A,
    LORA_B,
    AdapterFactors,
    PinnedFile,
    read_adapter_factors,
    read_adapter_header,
    sha256_file,
    validate_adapter,
    write_adapter,
)
from .factor_stage import FactorTensors, delta_bound_problems
from .factor_writer import FactorWriter
from .model import PROBE_OPTIONS, Context, Model

_uid = itertools.count(1)
CONTENT_CHECKS = 4  # targets whose live factors discovery reads back and compares with the file


class CheckedAdapter:
    """An adapter file checked against a model, with no llama.cpp call: what can run off the engine thread.

    The file is opened once (`PinnedFile`): validation (names, shapes, types, alpha, the bounded header
    reader), the factor read and the NaN/Inf and overflow checks all go through that descriptor, and
    llama.cpp later loads the same file through it. Parsing and checking cost grows with the file
    (about 40 s/GB for a crafted header before the reader was bounded; a real 100 MB adapter tens of
    ms), so `Engine.load_lora` does this on the caller's thread, and `LoRAAdapter` too; the engine thread
    only publishes the result. `close()` releases the descriptor (idempotent; `LoRAAdapter` closes it).
    """

    def __init__(self, model: Model, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.pin = PinnedFile(path)
        try:
            header = read_adapter_header(path, self.pin.fd)  # read once, for the checks and the factors
            self.info = validate_adapter(path, model.architecture, model.tensor_shapes, fd=self.pin.fd,
                                         header=header)
            # Read the factors once: for the NaN/Inf and overflow checks now, the discovery self-check and
            # the slot blocks and KV-guard gains of the load (runtime.py)
            self.factors = read_adapter_factors(path, fd=self.pin.fd, header=header, decode=N.decode_floats)
            _refuse_unusable(path, self.factors, self.info.alpha)
        except BaseException:
            self.pin.close()
            raise

    def close(self) -> None:
        self.pin.close()


def _refuse_unusable(path: str | os.PathLike[str], factors: AdapterFactors, alpha: float) -> None:
    flat = factors.flat  # the whole parse as one array: two passes clear a usable file
    if flat is not None and flat.size and math.isfinite(alpha):
        largest = float(np.max((flat.max(), -flat.min())))  # NaN propagates; the bytes between tensors count
        if math.isfinite(largest) and not delta_bound_problems(factors, alpha, largest):
            return
    bad = [t for t, (a, b) in factors.items() if not (np.isfinite(a).all() and np.isfinite(b).all())]
    if bad:
        raise AdapterError(str(path), "cannot be used",
                           problems=[f"{len(bad)} factor pairs contain NaN or Inf, e.g. {', '.join(bad[:3])}"])
    huge = delta_bound_problems(factors, alpha)
    if huge:
        raise AdapterError(str(path), "cannot be used: its delta could overflow F32", problems=huge,
                           hint="the factors (or alpha) are far outside any trained LoRA's range; "
                                "re-export the adapter (docs/server.md states the bound)")


class LoRAAdapter:
    """A LoRA adapter loaded against the base model.

    Attributes: ``name``, ``path``, ``rank``, ``alpha``, ``targets`` (base tensor names),
    ``dtype``, ``size`` (bytes), ``invocation_tokens`` (aLoRA), ``version`` (bumped by every write),
    ``writer`` (its `FactorWriter`: the one way its factors change).
    """

    def __init__(self, model: Model, file: str | os.PathLike[str] | CheckedAdapter, name: str,
                 between: Callable[[Callable[[], Any]], Any] | None = None, *, source: str | None = None) -> None:
        """Load `file` (a path, or a `CheckedAdapter` checked earlier on another thread) into llama.cpp.

        Any thread: llama.cpp's load and the tensor discovery (a graph built on a context of its own) share
        nothing with running decodes but the model's adapter set, which _native guards. `between` runs
        later reads and writes between decodes (the engine's `call_between_decodes`; without an engine
        they run on the caller's thread).
        """
        checked = file if isinstance(file, CheckedAdapter) else CheckedAdapter(model, file)
        try:
            self._load(model, checked, name, between, source)
        finally:
            checked.close()

    def _load(self, model: Model, checked: CheckedAdapter, name: str,
              between: Callable[[Callable[[], Any]], Any] | None, source: str | None) -> None:
        self.info, path, pin = checked.info, checked.path, checked.pin
        self.model = model
        self.name = name
        self.path = Path(path)
        self.source = source or str(path)
        self.uid = next(_uid)
        self._between = between or (lambda fn: fn())
        self._factors: dict[str, FactorTensors] | None = None
        self._sha: str | None = None
        self.handle = N.AdapterHandle.load(model.handle, pin.native_path)
        try:
            pin.close(check=True)  # refuses a file rewritten (or, without /proc, replaced) during the load
            tokens = self.handle.alora_invocation_tokens()
            self.invocation_tokens: tuple[int, ...] = tuple(tokens) or self.info.invocation_tokens
            self._factors = self._discover(checked.factors)
        except BaseException:
            self.handle.close()
            raise
        #: the only way this adapter's factors change (staging, one lock, the hop between decodes)
        self.writer = FactorWriter(name, self._factors, self.alpha, self.dtype, self._between)

    @property
    def version(self) -> int:
        """The content version: 0 as loaded, up by one with every published write (the writer's)."""
        return self.writer.version

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
        """alpha / rank of the first target (the factor llama.cpp applies on top of the scale; 1 when
        alpha is 0). Per-layer ranks have one factor per tensor: see tensor_scaling()."""
        return self.alpha / self.rank if self.alpha else 1.0

    def tensor_rank(self, name: str) -> int:
        """The rank of one target's factors (PEFT's rank_pattern gives targets different ranks)."""
        return self.info.shapes[name][0][0]

    @property
    def max_rank(self) -> int:
        """The largest rank over every target."""
        return max(a[0] for a, _ in self.info.shapes.values())

    def tensor_scaling(self, name: str) -> float:
        """The factor llama.cpp applies to one target's delta on top of the request scale: alpha over
        that tensor's own rank (`b->ne[0]` in llama-adapter.h), or 1 when alpha is 0."""
        return self.alpha / self.tensor_rank(name) if self.alpha else 1.0

    def __repr__(self) -> str:
        return f"LoRAAdapter({self.name!r}, rank={self.rank}, alpha={self.alpha}, targets={len(self.targets)})"

    # -- discovery ---------------------------------------------------------------------------
    def _discover(self, file_factors: dict[str, tuple[np.ndarray, np.ndarray]]) -> dict[str, FactorTensors]:
        found: dict[str, int] = {}

        def see(t: int) -> None:
            # llama.cpp's LoRA nodes take the factor as their first source: mul_mat(b, mul_mat(a, x)),
            # mul_mat_id(a, …) and get_rows(a, tokens) for embeddings (build_lora_mm* in llama-graph.cpp)
            s = N.node_src0(t)
            if s:
                nm = N.tensor_name(s)
                if nm.endswith((LORA_A, LORA_B)):
                    found.setdefault(nm, s)

        # The model's kept probe context: the graph built, not computed (a decode costs ~5x more)
        if not self.model.probe.look(self.handle, len(self.targets), see):
            self._discover_by_decode(see)
        return self._check_discovered(found, file_factors)

    def _discover_by_decode(self, see: Callable[[int], None]) -> None:
        """Where llama.cpp cannot build a graph without computing it: decode one token on a context of
        its own with this adapter, seeing every node through the eval callback."""
        def cb(t: int, ask: bool) -> bool:
            if ask:
                see(t)
            return False  # never split the graph; the ask pass sees every node

        # made after the adapter was loaded: llama.cpp sizes a context's graph for the adapters loaded by then
        ctx = Context(self.model, PROBE_OPTIONS, callback=cb)
        try:
            ctx.handle.set_adapters([self.handle], [1.0])
            ctx.prefill(0, [self.model.handle.bos if self.model.handle.bos >= 0 else 0])
        finally:
            ctx.close()

    def _check_discovered(self, found: dict[str, int],
                          file_factors: dict[str, tuple[np.ndarray, np.ndarray]]) -> dict[str, FactorTensors]:
        problems = []
        want = {t + s for t in self.targets for s in (LORA_A, LORA_B)}
        missing = sorted(want - set(found))
        if missing:
            problems.append(f"{len(missing)} factor tensors not found in the compute graph, e.g. {missing[:3]}")
        factors: dict[str, FactorTensors] = {}
        # Contents are compared for a spread of targets, shapes, types and sizes for every one: a wrong
        # struct mirror or name-to-tensor mapping is systematic, and reading every factor back would
        # cost the engine thread as much as the rest of the load.
        step = max(1, len(self.targets) // (CONTENT_CHECKS - 1))
        compare = set(self.targets[::step]) | set(self.targets[-1:])
        for t in self.targets if not missing else ():
            a, b = found[t + LORA_A], found[t + LORA_B]
            va, vb = N.tensor_view(a), N.tensor_view(b)
            a_shape, b_shape = self.info.shapes[t]
            if tuple(va.ne[:2]) != tuple(reversed(a_shape)) or tuple(vb.ne[:2]) != tuple(reversed(b_shape)):
                problems.append(f"{t}: graph tensor shapes {tuple(va.ne[:2])}/{tuple(vb.ne[:2])} differ from the file")
                continue
            if va.type not in FLOAT_NAMES or va.type != vb.type:
                problems.append(f"{t}: unexpected tensor types {va.type}/{vb.type}")
                continue
            esize = ELEMENT_SIZE[va.type]
            if N.tensor_nbytes(a) != esize * a_shape[0] * a_shape[1] or N.tensor_nbytes(b) != esize * b_shape[0] * b_shape[1]:
                problems.append(f"{t}: byte sizes differ from the shapes (ggml_tensor layout changed?)")
                continue
            f = FactorTensors(a, b, va.type, a_shape, b_shape)
            if t in compare:
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

    def _read(self, f: FactorTensors) -> tuple[np.ndarray, np.ndarray]:
        store = STORAGE_DTYPE[f.type]
        ra = N.tensor_get(f.a, np.empty(f.a_shape, dtype=store))
        rb = N.tensor_get(f.b, np.empty(f.b_shape, dtype=store))
        return decode(ra, f.type), decode(rb, f.type)

    # -- reads --------------------------------------------------------------------------------
    def factor_tensors(self) -> Mapping[str, FactorTensors]:
        """Where each target's factors live (ggml tensor pointers, type, shapes), read-only.

        For code that writes or reads those tensors itself between decodes (the slot bank).
        """
        self._check_open()
        assert self._factors is not None
        return MappingProxyType(self._factors)

    def factor_names(self) -> list[str]:
        """Base tensor names this adapter covers, in file order."""
        return list(self.targets)

    @property
    def n_factors(self) -> int:
        return len(self.targets)

    def get_factors(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """Read (A (r, in), B (out, r)) back from the live tensors, as float32."""
        # the open check runs where the read does (between decodes): a remove_lora queued before
        # this call has freed the tensors by then, and must raise, not read freed memory
        return self._between(lambda: self._read(self._factor(name)))

    def all_factors(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """Every factor pair read back from the live tensors."""
        def read() -> dict[str, tuple[np.ndarray, np.ndarray]]:
            self._check_open()  # between decodes, after any queued removal (see get_factors)
            assert self._factors is not None
            return {n: self._read(f) for n, f in self._factors.items()}
        return self._between(read)

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the current (live) factors to an adapter GGUF that loads anywhere llama.cpp does."""
        dtype = {"F32": "f32", "F16": "f16", "BF16": "bf16"}.get(self.dtype, "f32")
        return write_adapter(path, self.model.architecture, self.all_factors(), self.alpha, dtype=dtype,
                             invocation_tokens=list(self.invocation_tokens) or None, name=self.name)

    # -- writes: the adapter's FactorWriter --------------------------------------------------
    def set_factors(self, name: str, a: Any, b: Any) -> None:
        """Write one factor pair in place (A (r, in), B (out, r)); seen by every context at once."""
        self.writer.write({name: (a, b)})

    def set_factors_multi(self, factors: Mapping[str, tuple[Any, Any]]) -> None:
        """Write several factor pairs: all are validated first, then all are written (all-or-nothing).

        Arrays may be float32/float16/bfloat16 (numpy or torch); they are converted to the
        tensors' own type. The write happens between decodes, is seen by every context at once
        and bumps `version`. A refused update (unknown name, wrong shape or rank, NaN/Inf)
        writes nothing. While an `edit()` block of this adapter is open it raises FactorStateError.
        """
        self.writer.write(factors)

    def edit(self) -> contextlib.AbstractContextManager[dict[str, tuple[np.ndarray, np.ndarray]]]:
        """Edit every factor in place through writable numpy views; the fastest way to update many.

        ::

            with adapter.edit() as f:            # name -> (A (r, in), B (out, r)) views
                A, B = f["blk.0.attn_q.weight"]
                np.add(A, 0.01 * dA, out=A)      # any numpy writes, in the tensor's dtype

        The views start with the live values and belong to a staging copy: nothing reaches the
        model until the block ends. Then every factor is checked for NaN/Inf and all are written
        at once, between decodes, and `version` is bumped. An exception inside the block, or a
        NaN/Inf, discards the whole edit. F32 and F16 adapters only (BF16: use set_factors_multi).
        One block per adapter at a time: other writes (and a second edit()) meanwhile raise
        FactorStateError at once, never wait. The views must not be used after the block.
        """
        return self.writer.edit()

    def _factor(self, name: str) -> FactorTensors:
        self._check_open()
        if self._factors is None or name not in self._factors:
            raise FactorError(self.name, f"no factor named {name!r}", factor=name,
                              problems=[f"known factors start with {self.targets[:3]}"])
        return self._factors[name]

    def _check_open(self) -> None:
        if self.handle.closed:
            raise FactorError(self.name, "the adapter was unloaded",
                              problems=["load it again (Engine.load_lora) and use the new LoRAAdapter"])

    def close(self, wait: bool = True) -> bool:
        """Free the native adapter (only once no context uses it; the registry sees to that).

        The writer closes first: a write being published finishes, later ones raise. `wait=False`: return
        False instead of waiting for an adapter load running on another thread (try again later).
        """
        self.writer.close()
        return self.handle.close(wait)


__all__ = ["CheckedAdapter", "LoRAAdapter"]
