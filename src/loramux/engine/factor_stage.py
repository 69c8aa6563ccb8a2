"""The memory side of in-place factor writes: where factors live, the mirror, encoding, value checks.

A rank-2 update of every projection of a small model is 252 small arrays. Validating and writing
them one at a time (an `isfinite`, a dtype conversion and a ctypes call each) costs several
microseconds an array, far more than the bytes themselves. A `Mirror` keeps a copy of an
adapter's factor memory in the tensors' own storage type:

- `fill`: each incoming array is copied, and converted, straight into its place in the mirror;
- `check` / `largest`: one vectorised pass over the mirror (or over what was written, when little was);
- `commit` (between decodes): when the adapter's tensors sit in one host buffer, the mirror has the
  buffer's exact layout and one memcpy publishes the whole update; otherwise (a GPU buffer, a
  partial update) one `ggml_backend_tensor_set` per tensor, from addresses computed once.

Adapters over `MIRROR_MAX_BYTES` are written without a mirror, from arrays `encode` validated and
converted: there the bytes dominate, and a mirror would add two passes over them and double the
memory. Nothing here locks or decides when: `factor_writer.FactorWriter` owns an adapter's mirror,
its one lock and the hop between decodes; the adapter's tensors change only through it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import _native as N
from ..ggml_types import BF16, ELEMENT_SIZE, STORAGE_DTYPE, decode, to_bf16_bits

# The names adapters.py imports from here: ggml_types' own tables, not copies.

_PACK_ALIGN = 64
MIRROR_MAX_BYTES = 8 << 20  # above this, set_factors_multi writes tensor by tensor (see factor_writer.py)
# Largest gain a factor pair may have per unit of input (see delta_bound_problems and docs/server.md):
# F32 tops out near 2**128, so inputs up to 2**64 in magnitude (times the request scale) cannot overflow.
MAX_DELTA_GAIN = 2.0 ** 64


@dataclass
class FactorTensors:
    """Where one target's factors live: ggml_tensor pointers, ggml type, numpy shapes."""

    a: int  # ggml_tensor* of lora_a
    b: int
    type: int  # ggml type id of both
    a_shape: tuple[int, int]  # numpy (r, in)
    b_shape: tuple[int, int]  # numpy (out, r)


def as_float(x: Any) -> np.ndarray:
    """Accept float32/float16/bfloat16 (numpy, torch or ml_dtypes) arrays; return float32."""
    if hasattr(x, "detach"):  # torch tensor: bf16 has no numpy dtype, go through float32
        x = x.detach().float().cpu().numpy()
    arr = np.asarray(x)
    if arr.dtype.name == "bfloat16":
        arr = arr.astype(np.float32)
    if arr.dtype.kind != "f":
        raise TypeError(f"factors must be floating point, got {arr.dtype}")
    return arr.astype(np.float32, copy=False)


def _put(view: np.ndarray, x: Any, ggml_type: int) -> bool:
    """Copy `x` into `view` in the storage format; False (nothing copied) on a shape mismatch."""
    if type(x) is np.ndarray and x.dtype.kind == "f" and ggml_type != BF16:
        if x.shape != view.shape:
            return False
        np.copyto(view, x, casting="same_kind")  # the same rounding as astype
        return True
    arr = as_float(x)
    if arr.shape != view.shape:
        return False
    if ggml_type == BF16:
        view[...] = to_bf16_bits(arr)
    else:
        np.copyto(view, arr, casting="same_kind")
    return True


def _encoded(x: Any, shape: tuple[int, int], ggml_type: int) -> np.ndarray | None:
    """`x` as a contiguous array in the storage format (no copy when it already is); None on a shape mismatch."""
    arr = x if type(x) is np.ndarray and x.dtype.kind == "f" else as_float(x)
    if arr.shape != shape:
        return None
    if ggml_type == BF16:
        return to_bf16_bits(arr)
    return np.ascontiguousarray(arr, dtype=STORAGE_DTYPE[ggml_type])


def _as_f32(stored: np.ndarray, ggml_type: int) -> np.ndarray:
    """Stored factor elements as float32: F32 as they are, F16 and BF16 decoded (a copy)."""
    if ggml_type == BF16:
        return decode(stored, ggml_type)
    return stored if stored.dtype == np.float32 else stored.astype(np.float32)


def _max_abs(x: np.ndarray) -> float:
    """max |x| without a temporary array; NaN propagates (then the result is NaN)."""
    if x.size == 0:
        return 0.0
    return float(np.max((np.max(x), -np.min(x))))


def _all_finite(view: np.ndarray, ggml_type: int) -> bool:
    if ggml_type == BF16:  # exponent bits all ones: Inf or NaN
        return not bool(((view & 0x7F80) == 0x7F80).any())
    return bool(np.isfinite(view).all())


def encode(factors: Mapping[str, FactorTensors], update: Mapping[str, tuple[Any, Any]]
           ) -> tuple[list[str], list[tuple[int, np.ndarray]], dict[str, tuple[np.ndarray, np.ndarray]]]:
    """Validate and encode `update` for a direct (mirror-less) write into `factors`.

    Returns (problems, [(tensor, array in storage format)], {name: (A, B) as float32}); the floats
    are for the caller's value checks (NaN/Inf and the delta bound). Reads no live tensor.
    """
    problems: list[str] = []
    jobs: list[tuple[int, np.ndarray]] = []
    floats: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    with np.errstate(over="ignore", invalid="ignore"):
        for name, pair in update.items():
            f = factors.get(name)
            if f is None:
                problems.append(f"{name}: not a factor of this adapter (see factor_names())")
                continue
            try:
                a, b = pair
                ea, eb = _encoded(a, f.a_shape, f.type), _encoded(b, f.b_shape, f.type)
            except (TypeError, ValueError) as e:
                problems.append(f"{name}: {e}")
                continue
            if ea is None or eb is None:
                problems.append(_shape_problem(name, f, a, b))
            else:  # NaN/Inf (after conversion) are refused by the caller's delta bound over `floats`
                jobs += [(f.a, ea), (f.b, eb)]
                floats[name] = (_as_f32(ea, f.type), _as_f32(eb, f.type))
    return problems, jobs, floats


def total_bytes(factors: Mapping[str, FactorTensors]) -> int:
    """Bytes of every factor tensor of `factors` (what a mirror of them holds, without padding)."""
    return sum(_nbytes((0, f.type, s)) for f in factors.values() for s in (f.a_shape, f.b_shape))


class Mirror:
    """A copy of one adapter's factor memory, in the tensors' layout when they live on the host."""

    def __init__(self, factors: Mapping[str, FactorTensors]) -> None:
        self._factors = dict(factors)
        tensors = [(ptr, f.type, shape) for f in self._factors.values()
                   for ptr, shape in ((f.a, f.a_shape), (f.b, f.b_shape))]
        offsets, self._live = _mirror_layout([p for p, _, _ in tensors])
        if offsets is None:
            offsets = _packed_layout(tensors)
        size = [_nbytes(t) for t in tensors]
        end = max((o + n for o, n in zip(offsets, size)), default=0)
        self._buf = np.zeros(end, np.uint8)
        self.views: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self._raw: dict[str, tuple[tuple[int, int, int], tuple[int, int, int]]] = {}
        base = self._buf.ctypes.data
        for i, (name, f) in enumerate(self._factors.items()):
            pair = []
            for j in (2 * i, 2 * i + 1):
                ptr, gtype, shape = tensors[j]
                pair.append(self._buf[offsets[j]:offsets[j] + size[j]].view(STORAGE_DTYPE[gtype]).reshape(shape))
            self.views[name] = (pair[0], pair[1])
            self._raw[name] = ((f.a, base + offsets[2 * i], size[2 * i]), (f.b, base + offsets[2 * i + 1], size[2 * i + 1]))
        self.total_bytes = sum(size)
        types = {f.type for f in self._factors.values()}
        store = np.dtype(STORAGE_DTYPE[next(iter(types))]) if len(types) == 1 and BF16 not in types else None
        # one float view over the whole mirror (padding stays zero) for the one-pass finiteness test
        self._whole = self._buf.view(store) if store is not None and end % store.itemsize == 0 else None
        self.reload(list(self._factors))

    def reload(self, names: list[str]) -> None:
        """Copy the live tensors' contents into the mirror (at creation, and after a refused update)."""
        for name in names:
            for ptr, addr, nb in self._raw[name]:
                N.tensor_get(ptr, self._buf[addr - self._buf.ctypes.data:][:nb])

    def fill(self, factors: Mapping[str, tuple[Any, Any]]) -> tuple[list[str], list[str]]:
        """Copy the update into the mirror; returns (problems, names touched)."""
        with np.errstate(over="ignore", invalid="ignore"):  # values out of range become Inf: check() refuses them
            return self._fill(factors)

    def _fill(self, factors: Mapping[str, tuple[Any, Any]]) -> tuple[list[str], list[str]]:
        problems: list[str] = []
        touched: list[str] = []
        views = self.views
        for name, pair in factors.items():
            v = views.get(name)
            if v is None:
                problems.append(f"{name}: not a factor of this adapter (see factor_names())")
                continue
            touched.append(name)
            va, vb = v
            try:
                a, b = pair
                # the common case inline (a numpy float array of the right shape into F32/F16):
                # this loop runs once per factor pair, so every call saved is visible
                if (type(a) is np.ndarray and type(b) is np.ndarray and a.shape == va.shape
                        and b.shape == vb.shape and a.dtype.kind == "f" and b.dtype.kind == "f"
                        and va.dtype.kind == "f"):
                    va[...] = a  # the same rounding as astype
                    vb[...] = b
                    continue
                f = self._factors[name]
                if not (_put(va, a, f.type) & _put(vb, b, f.type)):
                    problems.append(_shape_problem(name, f, a, b))
            except (TypeError, ValueError) as e:
                problems.append(f"{name}: {e}")
        return problems, touched

    def check(self, touched: list[str]) -> list[str]:
        """Names among `touched` whose mirrored factors hold NaN or Inf (after conversion)."""
        if not touched:
            return []
        if self._whole is not None and 4 * self._bytes(touched) >= self.total_bytes:
            if np.isfinite(self._whole).all():  # one pass over the mirror (padding is zero)
                return []
        return [n for n in touched if not all(_all_finite(v, self._factors[n].type) for v in self.views[n])]

    def largest(self, touched: list[str]) -> float:
        """max |x| over the mirrored factors of `touched` (NaN if any is NaN, inf if any is infinite).

        One pair of reductions over the whole mirror when `touched` is most of it (padding is zero),
        so the delta bound costs about what the finiteness test did.
        """
        if not touched:
            return 0.0
        if self._whole is not None and 4 * self._bytes(touched) >= self.total_bytes:
            return _max_abs(self._whole)
        # np.max, not max(): it propagates a NaN wherever it is in the list
        return float(np.max([_max_abs(_as_f32(v, self._factors[n].type)) for n in touched for v in self.views[n]]))

    def floats(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """The mirrored (A, B) of `name` as float32 (copies for F16/BF16)."""
        t = self._factors[name].type
        a, b = self.views[name]
        return _as_f32(a, t), _as_f32(b, t)

    def commit(self, touched: list[str]) -> None:
        """Publish the mirrored factors of `touched` to the live tensors (call between decodes)."""
        if self._live is not None and 2 * self._bytes(touched) >= self.total_bytes:
            np.copyto(self._live, self._buf)
            return
        for name in touched:
            for ptr, addr, nb in self._raw[name]:
                N.tensor_set_raw(ptr, addr, nb)

    def _bytes(self, names: list[str]) -> int:
        if len(names) == len(self._factors):
            return self.total_bytes
        return sum(nb for n in names for _, _, nb in self._raw[n])


def _nbytes(t: tuple[int, int, tuple[int, int]]) -> int:
    _, gtype, shape = t
    return ELEMENT_SIZE[gtype] * shape[0] * shape[1]


def _mirror_layout(ptrs: list[int]) -> tuple[list[int] | None, np.ndarray | None]:
    """Offsets that copy the tensors' own layout, when they fill one host buffer without gaps.

    The gap check matters: the whole-buffer commit also writes the bytes between tensors, so it
    is used only when no gap is wide enough to hold anything but alignment padding.
    """
    where = [N.tensor_host_address(p) for p in ptrs]
    if not where or any(w is None for w in where) or len({w[1] for w in where}) != 1:  # type: ignore[index]
        return None, None
    addrs = [w[0] for w in where]  # type: ignore[index]
    sizes = [N.tensor_nbytes(p) for p in ptrs]
    align = N.buffer_alignment(where[0][1])  # type: ignore[index]
    spans = sorted(zip(addrs, sizes))
    for (a0, n0), (a1, _) in zip(spans, spans[1:]):
        if a1 < a0 + n0 or a1 - (a0 + n0) >= align:
            return None, None
    lo, hi = spans[0][0], spans[-1][0] + spans[-1][1]
    return [a - lo for a in addrs], N.host_bytes(lo, hi - lo)


def _packed_layout(tensors: list[tuple[int, int, tuple[int, int]]]) -> list[int]:
    offsets, at = [], 0
    for t in tensors:
        offsets.append(at)
        at += -(-_nbytes(t) // _PACK_ALIGN) * _PACK_ALIGN
    return offsets


def _shape_problem(name: str, f: FactorTensors, a: Any, b: Any) -> str:
    sa, sb = tuple(np.shape(a) if not hasattr(a, "shape") else a.shape), \
        tuple(np.shape(b) if not hasattr(b, "shape") else b.shape)
    hint = ""
    if len(sa) == 2 and len(sb) == 2 and (sa[0] != f.a_shape[0] or sb[1] != f.b_shape[1]):
        hint = f" (rank is fixed at {f.a_shape[0]}: a different rank is a new adapter)"
    return f"{name}: got A{sa} B{sb}, expected A{f.a_shape} B{f.b_shape}{hint}"


def delta_bound_problems(factors: Mapping[str, tuple[np.ndarray, np.ndarray]], alpha: float,
                         largest: float | None = None) -> list[str]:
    """Targets whose delta could overflow F32, as problem strings (empty: every target is safe).

    For a target with A (r, in) and B (out, r), llama.cpp computes s·B·(A·x) with s = scale·alpha/r
    (scale when alpha is 0). Per unit of input, A·x is at most g_A = max|A|·in and s·B times that
    at most g_B = |alpha/r|·max|B|·r. Each of g_A, g_B and g_A·g_B must be ≤ MAX_DELTA_GAIN (2^64):
    then no intermediate, no bank slot (which holds alpha/r·B) and no delta overflows for inputs
    whose magnitude times the request scale stays below 2^64. Trained adapters are below 10^6.
    A load checks it (adapters.CheckedAdapter), and so does every in-place write (factor_writer.py).
    `largest`: a finite bound on every |value| of every factor, used for each tensor's own max |x| (no
    pass over the tensors); a problem found with it may not be one, so check again without it.
    """
    if not np.isfinite(alpha):
        return [f"adapter.lora.alpha is {alpha}; it must be a finite number"]
    bad = []
    for name, (a, b) in factors.items():
        r, n_in = a.shape
        s = abs(alpha) / r if alpha else 1.0
        big_a, big_b = (largest, largest) if largest is not None else (_max_abs(a), _max_abs(b))
        if not (math.isfinite(big_a) and math.isfinite(big_b)):  # max/min propagate NaN and show ±Inf
            bad.append(f"{name}: factors contain NaN or Inf")
            continue
        g_a = big_a * n_in
        g_b = s * big_b * r
        if not (g_a <= MAX_DELTA_GAIN and g_b <= MAX_DELTA_GAIN and g_a * g_b <= MAX_DELTA_GAIN):
            bad.append(f"{name}: max|A|·in = {g_a:.3g}, |alpha/r|·max|B|·r = {g_b:.3g} (each and their "
                       f"product must be ≤ 2^64 ≈ {MAX_DELTA_GAIN:.3g})")
    return bad[:5] + ([f"… and {len(bad) - 5} more targets"] if len(bad) > 5 else [])


__all__ = ["MAX_DELTA_GAIN", "MIRROR_MAX_BYTES", "FactorTensors", "Mirror", "as_float", "delta_bound_problems",
           "encode", "total_bytes"]
