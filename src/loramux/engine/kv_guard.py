"""The KV guard: no sequence's keys and values can break the other sequences of its decode.

On a unified KV cache every sequence of a decode attends over every cell, the other sequences'
cells masked with -inf. llama.cpp's attention computes exp(-inf)·v = 0·v there, which is 0 only
while v is finite: one cell holding Inf or NaN (an adapter whose K or V overflows the F16 cache,
whose largest value is 65504) turns every other sequence of the decode into NaN, and the cells stay
poisoned for later decodes too. The delta bound at load (factor_stage.delta_bound_problems) keeps
values inside F32, not inside F16.

The guard stops the graph at each KV write (SET_ROWS: the K and V rows of the new tokens, each layer)
after it ran and before any attention reads the cells. A token whose values are not all within the
cache type's range gets its cells zeroed there (finite again: the masked others read 0·0) and is
reported, so that only its request fails. Stops cost time, so the guard runs only in decodes that
need it: those holding a *risky* adapter set, one whose values could leave the cache's range by the
static bound below, whatever the decode's size (a single sequence too: the cells it leaves behind are
read, masked, by later decodes; non-flash attention reads every cell of the padded window). The
bound holds for any input, so it is wide where a norm weight is large (docs/server.md gives what it
means on Gemma 3 270M); a set past it pays the stops for itself. The guard needs the slot bank's eval callback and one ubatch per decode on a unified cache;
an engine without them refuses a risky set at admission (ScaleError, a 400 on the server) instead of
paying an eval callback on every decode of every request.

Cells a failed request leaves are finite then (zeroed or checked), and a finite masked cell adds
exactly 0 to everyone's attention. A failure that could still have left out-of-range values (non-finite
logits the guard did not see: `may_leave_bad_values`) makes the scheduler clear the cache's data
(llama_memory_clear), see scheduler.py.

The bound (docs/server.md, "Numeric safety"): K and V are W·x + s·B·(A·x) with x = w ⊙ x̂ + b the
attention norm's output (RMSNorm or LayerNorm weight w, bias b of that layer, ||x̂||₂ ≤ √n_embd). So
|Δ_i| ≤ |s|·Σ_j |B_ij|·(||A_j ⊙ w||₂·√n_embd + |A_j·b|) for target t (s = alpha/r_t, baked into the
factors' scale): `folded_gain`, never wider than ||A_j||₂·||x||₂ with ||x||₂ ≤ √n_embd·max|w| + ||b||₂
(`x_bound`), and rotary embeddings grow a component by at most √2. An adapter set is risky when
Σ |scale|·(largest such |Δ| over its attn_k/attn_v targets) exceeds a quarter of the cache's range
(the rest is headroom for the base model's own values), or when Σ |scale|·g over its other targets
exceeds 2^20 (g = s·max_i Σ_j |B_ij|·max_j ||A_j||₂ per unit of input; short of what could overflow
F32 through the feed-forward products). When the norm weights are unknown (not F32/F16 in the file),
every adapter with attn_k/attn_v targets counts as risky.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from .. import _native as N
from .. import ggml_types as G
from ..errors import BackendError, RequestFailed, ScaleError
from .adapters import LoRAAdapter
from .model import Model
from .registry import AdapterSet

F16_MAX = 65504.0  # largest finite F16; block types (q8_0) keep F16 scales, so the same range
WIDE_LIMIT = 2.0**64  # F32/BF16 caches: far inside their range, so q·k products stay finite too
OTHER_GAIN_LIMIT = 2.0**20  # risky gain of a target that does not write K or V (see the docstring)
GAIN_CACHE_MAX = 4096  # (adapter, version) gains kept; cleared when exceeded
KV_TARGETS = ("attn_k", "attn_v")


def cache_limit(kv_type: str | int) -> float:
    """Largest |value| a KV cache of this type (name, or ggml type number) may be given."""
    wide = kv_type in ("f32", "bf16") or kv_type in (G.F32, G.BF16)
    return WIDE_LIMIT if wide else F16_MAX


def target_gain(a: np.ndarray, b: np.ndarray, scaling: float) -> float:
    """Largest |Δ_i| the pair adds per unit of ||x||₂: |scaling|·max_i Σ_j |B_ij|·max_j ||A_j||₂."""
    with np.errstate(over="ignore", invalid="ignore"):
        a_norm = float(np.sqrt(np.square(a.astype(np.float64)).sum(axis=1)).max(initial=0.0))
        # B's rows are r long: a product with ones sums them ~4× faster than sum(axis=1) does
        b_norm = float((np.abs(b.astype(np.float64)) @ np.ones(b.shape[1])).max(initial=0.0))
        g = abs(scaling) * b_norm * a_norm
    return g if math.isfinite(g) else math.inf


def attention_norms(model: Model) -> list[tuple[np.ndarray, np.ndarray]] | None:
    """Each layer's attention norm (weight w, bias b; b zeros without one); None when any is unknown."""
    out = []
    for i in range(model.n_layer):
        w = _read_vector(model, f"blk.{i}.attn_norm.weight")
        name = f"blk.{i}.attn_norm.bias"
        b = _read_vector(model, name) if name in model.header.tensors else np.zeros(model.n_embd, np.float32)
        if w is None or b is None or not (np.isfinite(w).all() and np.isfinite(b).all()):
            return None
        out.append((w, b))
    return out


def attention_input_bound(model: Model) -> float:
    """Bound on ||x||₂ of every layer's attention input (its norm's output); inf when unknown."""
    norms = attention_norms(model)
    if norms is None:
        return math.inf
    worst = max((math.sqrt(model.n_embd) * float(np.abs(w).max(initial=0.0)) + float(np.linalg.norm(b))
                 for w, b in norms), default=0.0)
    return worst if math.isfinite(worst) else math.inf


def folded_gain(a: np.ndarray, b: np.ndarray, scaling: float, w: np.ndarray, bias: np.ndarray, n: int) -> float:
    """Largest |Δ_i| the pair adds to a layer whose input is x = w ⊙ x̂ + bias with ||x̂||₂ ≤ √n (RMS or
    LayerNorm): |A_j·x| ≤ ||A_j ⊙ w||₂·√n + |A_j·bias|, tighter than ||A_j||₂·||x||₂ where the largest
    norm weights do not meet the largest factor entries."""
    with np.errstate(over="ignore", invalid="ignore"):
        a64 = a.astype(np.float64)
        reach = np.sqrt(np.square(a64 * w).sum(axis=1)) * math.sqrt(n) + np.abs(a64 @ bias.astype(np.float64))
        g = abs(scaling) * float((np.abs(b.astype(np.float64)) @ reach).max(initial=0.0))
    return g if math.isfinite(g) else math.inf


def _read_vector(model: Model, name: str) -> np.ndarray | None:
    """A 1-D F32/F16 tensor of the base model's file (norm weights are), None otherwise."""
    info = model.header.tensors.get(name)
    dtype = {G.F32: np.float32, G.F16: np.float16}.get(info.ggml_type) if info is not None else None
    if info is None or dtype is None or len(info.shape) != 1:
        return None
    n = info.shape[0]
    with open(model.path, "rb") as f:
        f.seek(model.header.data_offset + info.offset)
        raw = f.read(n * np.dtype(dtype).itemsize)
    if len(raw) != n * np.dtype(dtype).itemsize:
        return None
    return np.frombuffer(raw, dtype).astype(np.float32)


class KvCacheError(FloatingPointError):
    """Keys or values out of the KV cache's range that were dealt with: their cells were zeroed as they
    were written, or the cache's data cleared. Nothing of the failed request is left for others to read."""


def may_leave_bad_values(error: BaseException | None) -> bool:
    """Could a request failing with `error` have left out-of-range values in its KV cells? Non-finite
    logits the guard did not deal with say so, and so does a KV write the guard could not check."""
    if isinstance(error, BackendError):
        return error.function == "KV guard"
    return isinstance(error, RequestFailed) and isinstance(error.cause, FloatingPointError) \
        and not isinstance(error.cause, KvCacheError)


def read_bad_values_error(adapters: Iterable[str]) -> RequestFailed:
    """The error of a request whose decodes read cells another request left out of range (unified cache)."""
    return RequestFailed("decode", adapters, KvCacheError(
        "another request left non-finite keys or values in the shared KV cache, which every sequence's "
        "attention reads; this request was stopped rather than return what it computed from them, and the "
        "cache was cleared"), hint="retry the request")


class KvGuard:
    """Decides which decodes need the KV-write check, and runs it. Engine thread only.

    `stops` is the serving context's eval callback (None when the context has none: the guard cannot
    run there, and the scheduler refuses risky sets instead; see `refusal`).
    """

    def __init__(self, model: Model, stops: N.MatmulStops | None, kv_type: str) -> None:
        self.stops, self.kv_type = stops, kv_type
        self.risk_limit = cache_limit(kv_type) / 4 / math.sqrt(2)
        self.x_bound = attention_input_bound(model)
        self._norms = attention_norms(model) if math.isfinite(self.x_bound) else None
        self._n_embd = model.n_embd
        self._gains: dict[tuple[int, int], tuple[float, float]] = {}
        self._n_tok = 0
        self._bad = np.zeros(0, bool)
        self.last_bad = np.zeros(0, np.int64)  # batch indices zeroed in the last guarded decode
        self.problems: list[str] = []
        self.guarded_decodes = 0  # decodes that ran with the check
        self.zeroed_tokens = 0  # tokens whose cells were zeroed (their requests failed)

    @property
    def available(self) -> bool:
        return self.stops is not None

    def gains(self, adapter: LoRAAdapter, factors: Mapping[str, tuple[np.ndarray, np.ndarray]] | None = None
              ) -> tuple[float, float]:
        """(largest g of its attn_k/attn_v targets, largest g of its other targets), for its current factors.

        A K/V target's g is its largest |Δ| over every input its layer's norm can give, divided by
        `x_bound` (so g·x_bound bounds |Δ|); with the norm unknown, the plain `target_gain`. `factors`: its
        parsed file, for an adapter as loaded (version 0), so that the engine thread never computes them."""
        key = (adapter.uid, adapter.version)
        got = self._gains.get(key)
        if got is None:
            kv = other = 0.0
            if factors is not None and adapter.version != 0:
                factors = None  # written in place since: its file is not its factors
            for t, (a, b) in (factors if factors is not None else adapter.all_factors()).items():
                parts = t.split(".")
                if parts[-2] in KV_TARGETS:
                    kv = max(kv, self._kv_gain(a, b, adapter.tensor_scaling(t), parts))
                else:
                    other = max(other, target_gain(a, b, adapter.tensor_scaling(t)))
            if len(self._gains) >= GAIN_CACHE_MAX:
                self._gains.clear()
            got = self._gains[key] = (kv, other)
        return got

    def _kv_gain(self, a: np.ndarray, b: np.ndarray, scaling: float, parts: list[str]) -> float:
        layer = int(parts[1]) if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() else -1
        if self._norms is None or not 0 <= layer < len(self._norms):
            return target_gain(a, b, scaling)
        w, bias = self._norms[layer]
        return folded_gain(a, b, scaling, w, bias, self._n_embd) / self.x_bound

    def risky(self, sets: Iterable[AdapterSet]) -> bool:
        """Could a token on any of these adapter sets write K/V outside the cache's range?"""
        for s in sets:
            kv = other = 0.0
            for a, scale in s.items:
                g_kv, g_other = self.gains(a)
                kv += abs(scale) * g_kv
                other += abs(scale) * g_other
            if other > OTHER_GAIN_LIMIT or (kv > 0 and kv * self.x_bound > self.risk_limit):
                return True
        return False

    def safe_scale(self, adapter: LoRAAdapter) -> float:
        """The largest |scale| at which `adapter` alone is not risky (inf: any scale)."""
        g_kv, g_other = self.gains(adapter)
        with np.errstate(divide="ignore"):
            edges = [self.risk_limit / (g_kv * self.x_bound) if g_kv > 0 else math.inf,
                     OTHER_GAIN_LIMIT / g_other if g_other > 0 else math.inf]
        return min(edges)

    def overflow_error(self, adapters: Iterable[str]) -> RequestFailed:
        """The error of a request whose cells the guard zeroed."""
        return RequestFailed("decode", adapters, KvCacheError(
            f"its keys or values left the {self.kv_type} KV cache's range (NaN, Inf or |x| > "
            f"{cache_limit(self.kv_type):g}); it was stopped and its cells were zeroed as they were written, so "
            f"no other request reads them"), hint="lower the adapter's scale or check its factors")

    def refusal(self, sets: Sequence[AdapterSet]) -> ScaleError:
        """The error for a risky set on an engine that cannot run the guard: nothing was decoded."""
        risky = next((s for s in sets if self.risky([s])), sets[0])
        named = ", ".join(f"{a.name} × {scale:g}" for a, scale in risky.items)
        hint = "lower the scale"
        if len(risky.items) == 1:
            hint += f" (this engine serves {risky.items[0][0].name} at |scale| ≤ {self.safe_scale(risky.items[0][0]):.4g})"
        return ScaleError(
            f"{named}: its keys or values could leave the {self.kv_type} KV cache's range by the bound this engine "
            f"checks (docs/server.md, 'Numeric safety'), and this engine cannot check them as they are written "
            f"(that needs the slot bank on a unified KV cache), so it does not serve it",
            hint=hint + ", or serve with a slot bank (loramux serve --slots N; Engine.load(..., slots=N)), whose "
                        "KV guard checks such requests")

    # -- one guarded decode ---------------------------------------------------------------------
    def arm(self, n_tokens: int) -> None:
        """Check every KV write of the next decode, a batch of `n_tokens` in one ubatch."""
        assert self.stops is not None
        self._n_tok, self._bad = n_tokens, np.zeros(n_tokens, bool)
        self.problems = []
        self.stops.guard = self._on_write
        self.guarded_decodes += 1

    def disarm(self) -> np.ndarray:
        """End the guarded decode: the batch indices of the tokens whose cells were zeroed. Raises
        BackendError when a KV write could not be checked (its layout is not the one this expects)."""
        if self.stops is not None:
            self.stops.guard = None
        self.last_bad = np.flatnonzero(self._bad)
        self.zeroed_tokens += len(self.last_bad)
        if self.problems:
            raise BackendError("KV guard", None, "; ".join(self.problems[:3]),
                               hint="llama.cpp's KV writes no longer match the guard; serve without slots")
        return self.last_bad

    def hit_entries(self, sizes: Sequence[int]) -> set[int]:
        """Which of the batch's entries (consecutive runs of `sizes` tokens, in batch order) hold a token
        the last guarded decode zeroed."""
        if not len(self.last_bad):
            return set()
        ends = np.cumsum(sizes)
        return set(np.searchsorted(ends, self.last_bad, side="right").tolist())

    def _on_write(self, t: int) -> None:
        """After one KV write: zero the cells of every token with a value out of range; never raise."""
        try:
            self._check_write(t)
        except Exception as e:  # noqa: BLE001 - raising here would cut the graph short
            self.problems.append(f"KV guard failed: {type(e).__name__}: {e}")

    def _check_write(self, t: int) -> None:
        parts = N.set_rows_parts(t)
        if parts is None:
            self.problems.append("a KV write whose values are not contiguous F32 rows")
            return
        values, where, dst_type, row_bytes = parts
        n_tok, rows = self._n_tok, values.shape[0]
        if n_tok == 0 or rows % n_tok or len(where) != rows:
            self.problems.append(f"a KV write of {rows} rows for {n_tok} tokens")
            return
        per_token = values.reshape(n_tok, -1)  # K, V: a row per token; transposed V: n_embd rows each
        with np.errstate(invalid="ignore"):
            bad = ~(np.abs(per_token).max(axis=1) <= cache_limit(dst_type))  # NaN compares False
        if bad.any():
            span = rows // n_tok
            dead = (np.flatnonzero(bad)[:, None] * span + np.arange(span)).ravel()
            N.zero_rows(t, where[dead], row_bytes)
            self._bad |= bad


__all__ = ["F16_MAX", "KvCacheError", "KvGuard", "attention_input_bound", "attention_norms", "cache_limit",
           "folded_gain", "may_leave_bad_values", "read_bad_values_error", "target_gain"]
