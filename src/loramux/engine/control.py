"""Control vectors: directions added to the residual stream of chosen layers, beside the adapters.

File format and layer convention (llama.cpp's, checked against its source and by test):

- A control-vector GGUF has ``general.architecture = controlvector``, ``controlvector.model_hint``
  (the base model's architecture), ``controlvector.layer_count`` and one 1-D F32 tensor
  ``direction.N`` per layer, N ≥ 1.
- llama.cpp's loader puts ``direction.N`` into row N-1 of the buffer it hands to
  ``llama_set_adapter_cvec``; that function copies row N-1 into the tensor of block N, and the graph adds
  it to the output of block N (0-based), i.e. to the residual-stream node ``l_out-N``. So
  **direction.N shifts l_out-N**. Block 0 never gets a vector, and on a model with n_layer blocks
  ``direction.<n_layer>`` is accepted but never applied.
- llama.cpp's cvector-generator measures at ``l_out-il`` but writes ``direction.(il+1)``, so its vectors
  act one block later than where they were measured. `ControlVector.train` writes ``direction.N`` for a
  vector measured at ``l_out-N``: it acts exactly where it was measured.
- A layer range (A, B) is inclusive and in the same numbering: direction.N applies when A ≤ N ≤ B.

`ControlSetting` is what an engine applies: the strength-weighted sum of one or more vectors as one
(n_layer × n_embd) float32 array (row k = direction.(k+1)), a layer range, and a `key` (a hash of exactly
what is applied) that the scheduler uses to group requests and to keep KV prefixes apart.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import numbers
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

import numpy as np

from .. import _native as N
from ..errors import BackendError, ContextLengthError, ControlVectorError, ParameterError
from ..gguf_io import read_control_vector, write_control_vector
from .model import Context, ContextOptions, Model

log = logging.getLogger("loramux")
T = TypeVar("T")

METHODS = ("pca", "mean")
POOLS = ("last", "mean")


def parse_layers(text: str | None) -> tuple[int, int] | None:
    """``"A-B"`` → (A, B) (inclusive, 1-based like direction.N); ``"N"`` → (N, N); None/"" → None."""
    if text is None or not str(text).strip():
        return None
    s = str(text).strip()
    head, sep, tail = s.partition("-")
    try:
        a = int(head)
        b = int(tail) if sep else a
    except ValueError:
        raise ParameterError("layers", f"{s!r} is not a layer range",
                             hint="write A-B with integers, e.g. 6-14 (inclusive, 1-based)") from None
    if a > b:
        raise ParameterError("layers", f"{s!r}: start {a} is after end {b}", hint="write A-B with A ≤ B")
    return a, b


class EngineLike(Protocol):
    """What training and residual capture need from an engine (an `Engine` has all of it)."""

    model: Model

    @property
    def n_threads(self) -> int: ...

    def tokenize(self, text: str) -> list[int]: ...

    def call(self, fn: Callable[[], T]) -> T: ...


# ---------------------------------------------------------------------------------------------------
# ControlVector: the file
# ---------------------------------------------------------------------------------------------------

@dataclass(eq=False)
class ControlVector:
    """Per-layer directions, keyed like llama.cpp's file: ``directions[N]`` is ``direction.N`` (N ≥ 1).

    `stats` holds per-layer training diagnostics (not saved in the file).
    """

    directions: dict[int, np.ndarray]
    model_hint: str = ""
    source: str = "<memory>"
    stats: dict[int, dict[str, float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.directions = {int(k): np.ascontiguousarray(v, dtype=np.float32).reshape(-1)
                           for k, v in sorted(self.directions.items())}

    # -- facts -------------------------------------------------------------------------------------
    @property
    def layers(self) -> list[int]:
        return sorted(self.directions)

    @property
    def n_embd(self) -> int | None:
        """Length of the directions (None when empty or when they disagree; see `problems`)."""
        sizes = {v.size for v in self.directions.values()}
        return sizes.pop() if len(sizes) == 1 else None

    def norms(self) -> dict[int, float]:
        """L2 norm of each layer's direction."""
        return {k: float(np.linalg.norm(v)) for k, v in self.directions.items()}

    def problems(self) -> list[str]:
        """What is wrong with the vector on its own (llama.cpp's loader would refuse it)."""
        out = []
        if not self.directions:
            out.append("no directions")
        bad = [k for k in self.directions if k < 1]
        if bad:
            out.append(f"layer indices {bad} are not ≥ 1 (llama.cpp refuses direction.0 and below)")
        sizes = sorted({v.size for v in self.directions.values()})
        if len(sizes) > 1:
            out.append(f"directions have different lengths {sizes}; all must have the model's n_embd")
        for k, v in self.directions.items():
            n_bad = int((~np.isfinite(v)).sum())
            if n_bad:
                out.append(f"direction.{k} has {n_bad} non-finite values (NaN/inf)")
        return out

    def scaled(self, factor: float) -> ControlVector:
        """A copy with every direction multiplied by `factor`."""
        return ControlVector({k: v * np.float32(factor) for k, v in self.directions.items()},
                             self.model_hint, f"{self.source}×{factor:g}")

    # -- files -------------------------------------------------------------------------------------
    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> ControlVector:
        """Read a control-vector GGUF (llama.cpp's format). Raises ControlVectorError listing every problem."""
        p = Path(path).expanduser()
        if not p.is_file():
            raise ControlVectorError(str(p), "file not found" if not p.exists() else "not a regular file",
                                     hint="pass the path of a control-vector .gguf")
        hint, dirs = read_control_vector(p)
        cv = cls(dirs, str(hint or ""), str(p))
        problems = cv.problems()
        if problems:
            raise ControlVectorError(str(p), "not a usable control vector", problems=problems)
        return cv

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write llama.cpp's control-vector GGUF (atomically). Refuses a vector llama.cpp would refuse."""
        problems = self.problems()
        if problems:
            raise ControlVectorError(str(path), "refusing to write an invalid control vector", problems=problems)
        return write_control_vector(path, self.directions, self.model_hint or "", len(self.directions))

    # -- training ----------------------------------------------------------------------------------
    @classmethod
    def train(cls, engine: EngineLike, positive: Sequence[str], negative: Sequence[str], *, method: str = "pca",
              layers: tuple[int, int] | None = None, progress: bool = True, pool: str = "mean") -> ControlVector:
        """Compute a vector from paired examples: positive[i] and negative[i] differ in the trait.

        Runs the base model (no adapters, no control vector) on each example on the engine thread,
        between its other work, and reads the residual stream ``l_out-N`` of every layer N in `layers`
        (default 1..n_layer-1, every layer llama.cpp can apply). `pool` averages each example's residual
        over its tokens ("mean", default: the vector is added at every position, so it is measured at
        every position) or takes the last token's ("last"). Per layer, with D the paired differences
        (positive − negative):

        - "mean": the mean of D;
        - "pca": the first principal component of the pair-centred activations (each pair centred on
          its midpoint, i.e. the points ±D/2), signed so that it points from negative to positive, and
          scaled to the mean projection of D on it.

        Both are in the units of the residual stream: strength 1.0 shifts a layer by the average
        positive−negative difference measured there. `stats` reports per layer the norm, the fraction of
        pairs whose difference agrees in sign with the direction, and (pca) the variance it explains.
        """
        return _train(cls, engine, positive, negative, method=method, layers=layers, progress=progress,
                      pool=pool)


# ---------------------------------------------------------------------------------------------------
# ControlSetting: what an engine applies
# ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True, eq=False)
class ControlSetting:
    """Summed, validated control vectors for one model, ready for `llama_set_adapter_cvec`.

    `data` is (n_layer × n_embd) float32, row k = direction.(k+1); `layers` the inclusive range applied.
    Settings are equal (and share a `key`) when they apply exactly the same numbers to the same layers.
    """

    data: np.ndarray
    n_embd: int
    layers: tuple[int, int]
    key: tuple[str, str]
    parts: tuple[tuple[str, float], ...] = ()

    @classmethod
    def build(cls, model: Model | EngineLike, vectors: Iterable[tuple[ControlVector, float]],
              layers: tuple[int, int] | None = None) -> ControlSetting:
        """Sum strength·direction over `vectors` for `model` (a Model, or an Engine) and check the fit.

        Raises one ControlVectorError listing every problem: n_embd mismatch, a layer beyond the model,
        a bad layer range, non-finite directions, strengths or sums. Layers default to 1..n_layer.
        """
        model = getattr(model, "model", model)
        n_layer, n_embd = int(model.n_layer), int(model.n_embd)
        pairs = [(v, s) for v, s in vectors]
        problems: list[tuple[str, str]] = []  # (source, problem)
        rng = (1, n_layer) if layers is None else (int(layers[0]), int(layers[1]))
        if not (1 <= rng[0] <= rng[1] <= n_layer):
            problems.append(("", f"layer range {rng[0]}-{rng[1]} is outside 1-{n_layer} (this model has "
                                 f"{n_layer} layers; the range is inclusive and 1-based, start ≤ end)"))
        data = np.zeros((n_layer, n_embd), np.float32)
        for vec, strength in pairs:
            found = _fit_problems(vec, strength, n_layer, n_embd)
            problems += [(vec.source, p) for p in found]
            if not found:
                # float32, in list order, like llama.cpp's loader; overflow is reported below
                with np.errstate(over="ignore", invalid="ignore"):
                    for k, d in vec.directions.items():
                        data[k - 1] += np.float32(strength) * d
        if not problems and not np.isfinite(data).all():
            problems.append(("", "the strength-weighted sum overflows to non-finite values; lower the strengths"))
        if problems:
            _raise_fit(problems, pairs)
        _warn_unapplied(pairs, n_layer, model)
        data.flags.writeable = False  # the key fingerprints these numbers: keep them fixed
        digest = hashlib.sha256(data.tobytes() + f"|{rng[0]}-{rng[1]}".encode()).hexdigest()
        return cls(data, n_embd, rng, ("cvec", digest), tuple((v.source, float(s)) for v, s in pairs))

    @classmethod
    def from_any(cls, model: Model | EngineLike, cv: ControlSource, strength: float = 1.0,
                 layers: tuple[int, int] | None = None) -> ControlSetting:
        """Build from a vector or path, a list of vectors, paths or (vector|path, strength) pairs (a bare
        vector or path gets `strength`), or a ControlSetting (as is, or rescaled / re-ranged)."""
        if isinstance(cv, ControlSetting):
            if strength == 1.0 and layers in (None, cv.layers):
                return cv
            rows = ControlVector({k + 1: r for k, r in enumerate(cv.data)}, source=repr(cv))
            return cls.build(model, [(rows, strength)], layers or cv.layers)
        items = cv if isinstance(cv, list | tuple) and not _is_pair(cv) else [cv]
        pairs = []
        for item in items:
            v, s = item if _is_pair(item) else (item, strength)
            pairs.append((v if isinstance(v, ControlVector) else ControlVector.load(v), float(s)))
        return cls.build(model, pairs, layers)

    @property
    def is_zero(self) -> bool:
        """True when nothing is added to any applied layer."""
        lo, hi = self.layers
        return not self.data[lo - 1:hi].any()

    def apply(self, ctx_handle: N.ContextHandle) -> None:
        """Set this setting on a native context (`_native.ContextHandle`)."""
        ctx_handle.set_control_vector(self.data, self.n_embd, self.layers[0], self.layers[1])

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ControlSetting) and other.key == self.key

    def __hash__(self) -> int:
        return hash(self.key)

    def __repr__(self) -> str:
        parts = ", ".join(f"{Path(s).name}:{x:g}" for s, x in self.parts)
        return f"ControlSetting([{parts}], layers={self.layers[0]}-{self.layers[1]}, key={self.key[1][:12]})"


def _is_pair(x: Any) -> bool:
    return isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], numbers.Real) and not isinstance(x[1], bool)


def _fit_problems(vec: ControlVector, strength: float, n_layer: int, n_embd: int) -> list[str]:
    out = list(vec.problems())
    if not isinstance(strength, numbers.Real) or not math.isfinite(float(strength)):
        out.append(f"strength {strength!r} is not a finite number")
    elif abs(float(strength)) > float(np.finfo(np.float32).max):
        out.append(f"strength {strength!r} is beyond float32 range")
    sizes = sorted({v.size for v in vec.directions.values()})
    if sizes and sizes != [n_embd]:
        out.append(f"directions have {', '.join(map(str, sizes))} values but the model's n_embd is {n_embd} "
                   "(made for another model?)")
    beyond = [k for k in vec.layers if k > n_layer]
    if beyond:
        out.append(f"layers {beyond} are beyond the model's {n_layer} layers (made for a deeper model?)")
    return out


def _raise_fit(problems: list[tuple[str, str]], pairs: list[tuple[ControlVector, float]]) -> None:
    sources = list(dict.fromkeys(s for s, _ in problems if s))
    several = len({v.source for v, _ in pairs}) > 1
    lines = [f"{s}: {p}" if (several and s) else p for s, p in problems]
    where = ", ".join(sources) if sources else ", ".join(v.source for v, _ in pairs) or "(none)"
    raise ControlVectorError(where, "does not fit the model", problems=lines,
                             hint="use a vector made for this model (same n_embd and layer count), "
                                  "finite strengths, and a layer range within 1..n_layer")


def _warn_unapplied(pairs: list[tuple[ControlVector, float]], n_layer: int, model: Model) -> None:
    arch = getattr(model, "architecture", None)
    for vec, _ in pairs:
        if n_layer in vec.directions and vec.directions[n_layer].any():
            log.warning("control vector %s: direction.%d is never applied by llama.cpp (it adds direction.N "
                        "after block N, blocks 1..%d)", vec.source, n_layer, n_layer - 1)
        if vec.model_hint and arch and vec.model_hint != arch:
            log.warning("control vector %s was made for %r, the model is %r", vec.source, vec.model_hint, arch)


# ---------------------------------------------------------------------------------------------------
# Capturing the residual stream and training
# ---------------------------------------------------------------------------------------------------

class ResidualCapture:
    """A dedicated context whose eval callback records the residual stream ``l_out-N`` for chosen N.

    Create, run and close it on the engine thread (`engine.call`), so it never overlaps a decode.
    Each `run` decodes one text in a single micro-batch from an empty cache.
    """

    def __init__(self, model: Model, layers: Iterable[int], n_ctx: int, n_threads: int | None = None) -> None:
        self.model = model
        self.want = set(layers)
        self.out: dict[int, np.ndarray] = {}
        self._applied: Any = None  # key of the control setting on the context (a new one has none)
        opts = ContextOptions(n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, n_seq_max=1, n_threads=n_threads)
        self.ctx = Context(model, opts, callback=self._callback)

    def _callback(self, t: int, ask: bool) -> bool:
        name = N.tensor_name(t)
        if ask:
            return name.startswith("l_out-") and name[6:].isdigit() and int(name[6:]) in self.want
        # ask=False: only for nodes we asked for. Never return False here (it truncates the graph).
        v = N.tensor_view(t)
        n_embd, rows = int(v.ne[0]), int(v.ne[1])
        if v.type != 0 or int(v.nb[1]) != 4 * n_embd or int(v.ne[2]) * int(v.ne[3]) != 1:
            log.error("residual %s is not a contiguous F32 matrix; not captured", name)
            return True
        self.out[int(name[6:])] = N.tensor_get(t, np.empty((rows, n_embd), np.float32))
        return True

    def run(self, tokens: Sequence[int], *, all_rows: bool = True, control: ControlSetting | None = None) -> dict[int, np.ndarray]:
        """Decode `tokens` and return {N: l_out-N (rows, n_embd)}.

        The last block keeps only the rows that request logits: all of them with `all_rows`, else the
        last token's alone. `control` (a ControlSetting) is applied during the decode, None clears it.
        """
        if len(tokens) > self.ctx.n_batch:
            raise ContextLengthError(len(tokens), self.ctx.n_batch, "example")
        h = self.ctx.handle
        key = getattr(control, "key", None)
        if key != self._applied:  # setting it makes the next decode re-reserve the graph: only on change
            if control is None:
                h.set_control_vector(None, self.model.n_embd, 0, 0)
            else:
                control.apply(h)
            self._applied = key
        self.ctx.clear()
        self.out = {}
        b = self.ctx.batch
        b.clear()
        b.add(list(tokens), 0, 0, True if all_rows else [False] * (len(tokens) - 1) + [True])
        h.decode(b)
        missing = self.want - set(self.out)
        if missing:
            raise BackendError("cb_eval", None, f"residual nodes l_out-{sorted(missing)} were not seen",
                               hint="this model's graph does not name its residual stream l_out-N")
        return self.out

    def close(self) -> None:
        self.ctx.close()


def residual_stream(engine: EngineLike, text: str | Sequence[int], *, layers: Iterable[int] | None = None,
                    control: ControlSetting | None = None) -> dict[int, np.ndarray]:
    """The residual stream after each block, {N: (n_tokens, n_embd)}, for one text on the base model.

    `control` (a ControlSetting or None) is applied while decoding. Useful to see what a vector does.
    """
    model = engine.model
    toks = engine.tokenize(text) if isinstance(text, str) else list(text)
    want = range(model.n_layer) if layers is None else layers

    def run() -> dict[int, np.ndarray]:
        cap = ResidualCapture(model, want, max(len(toks), 8), _engine_threads(engine))
        try:
            return {k: v.copy() for k, v in sorted(cap.run(toks, all_rows=True, control=control).items())}
        finally:
            cap.close()
    return engine.call(run)


def _engine_threads(engine: EngineLike) -> int | None:
    return engine.n_threads


def _check_training_args(model: Model, positive: Sequence[str], negative: Sequence[str], method: str,
                         layers: tuple[int, int] | None, pool: str) -> tuple[int, int]:
    problems = []
    if method not in METHODS:
        problems.append(f"method {method!r} is not one of {', '.join(METHODS)}")
    if pool not in POOLS:
        problems.append(f"pool {pool!r} is not one of {', '.join(POOLS)}")
    if len(positive) != len(negative):
        problems.append(f"{len(positive)} positive but {len(negative)} negative examples (they are paired)")
    if not positive:
        problems.append("no examples")
    empty = [i for i, t in enumerate(list(positive) + list(negative)) if not str(t).strip()]
    if empty:
        problems.append(f"{len(empty)} examples are empty")
    top = model.n_layer - 1  # llama.cpp applies direction.N to blocks 1..n_layer-1
    lo, hi = layers if layers is not None else (1, top)
    if not 1 <= lo <= hi <= top:
        problems.append(f"layers {lo}-{hi} are outside 1-{top} (the layers llama.cpp can apply on this model)")
    if problems:
        raise ParameterError("ControlVector.train", "cannot train", hint="; ".join(problems))
    return lo, hi


def _train(cls: type[ControlVector], engine: EngineLike, positive: Sequence[str], negative: Sequence[str], *,
           method: str, layers: tuple[int, int] | None, progress: bool, pool: str) -> ControlVector:
    from tqdm.auto import tqdm

    model = engine.model
    lo, hi = _check_training_args(model, positive, negative, method, layers, pool)
    want = list(range(lo, hi + 1))
    pos = [engine.tokenize(t) for t in positive]
    neg = [engine.tokenize(t) for t in negative]
    n_ctx = max(len(t) for t in pos + neg)
    limit = getattr(engine, "n_ctx", None)
    if limit is not None and n_ctx > limit:
        raise ContextLengthError(n_ctx, limit, "the longest training example")
    cap = engine.call(lambda: ResidualCapture(model, want, max(n_ctx, 8), _engine_threads(engine)))
    acts = {k: np.zeros((2, len(pos), model.n_embd), np.float64) for k in want}

    def pooled(tokens: list[int]) -> dict[int, np.ndarray]:
        out = cap.run(tokens, all_rows=pool == "mean")
        return {k: (v[-1] if pool == "last" else v.mean(axis=0)).astype(np.float64) for k, v in out.items()}
    try:
        # one engine call per pair: serving requests interleave with training
        for i in tqdm(range(len(pos)), desc="capturing residuals", unit="pair", disable=not progress):
            p, n = engine.call(lambda i=i: (pooled(pos[i]), pooled(neg[i])))
            for k in want:
                acts[k][0, i], acts[k][1, i] = p[k], n[k]
    finally:
        engine.call(cap.close)
    directions, stats = {}, {}
    for k in want:
        directions[k], stats[k] = direction_from_pairs(acts[k][0], acts[k][1], method)
    return cls(directions, model.architecture, f"trained:{method}:{len(pos)} pairs", stats)


def direction_from_pairs(pos: np.ndarray, neg: np.ndarray, method: str = "pca") -> tuple[np.ndarray, dict[str, float]]:
    """One layer's direction from paired activations (n_pairs, n_embd) each, and its diagnostics."""
    d = np.asarray(pos, np.float64) - np.asarray(neg, np.float64)
    mean = d.mean(axis=0)
    stats: dict[str, float] = {}
    if method == "mean":
        vec = mean
    elif method == "pca":
        # Centring each pair on its midpoint gives the points ±d/2, whose mean is exactly zero: their
        # first principal component is the top right-singular vector of d. (Centring the differences
        # themselves would subtract the mean difference, which is the signal.)
        _, s, vt = np.linalg.svd(d, full_matrices=False)
        unit = vt[0] if mean @ vt[0] >= 0 else -vt[0]
        vec = unit * float((d @ unit).mean())
        stats["explained"] = float(s[0] ** 2 / max((s ** 2).sum(), 1e-30))
    else:
        raise ParameterError("method", f"{method!r} is not one of {', '.join(METHODS)}")
    norm = float(np.linalg.norm(vec))
    stats["norm"] = norm
    stats["agree"] = float(((d @ vec) > 0).mean()) if norm > 0 else 0.0
    stats["diff_norm"] = float(np.linalg.norm(d, axis=1).mean())
    return vec.astype(np.float32), stats


# ---------------------------------------------------------------------------------------------------
# Example files
# ---------------------------------------------------------------------------------------------------

def read_examples(path: str | os.PathLike[str]) -> list[str]:
    """One example per non-blank line (.txt), or the "text" field of each line of a .jsonl file."""
    p = Path(path).expanduser()
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise ParameterError(str(p), f"cannot read: {e.strerror or e}") from e
    if p.suffix.lower() != ".jsonl":
        return [ln for ln in lines if ln.strip()]
    out = []
    for i, ln in enumerate(lines, 1):
        if not ln.strip():
            continue
        try:
            obj = json.loads(ln)
            text = obj["text"] if isinstance(obj, dict) else None
        except (json.JSONDecodeError, KeyError):
            text = None
        if not isinstance(text, str):
            raise ParameterError(str(p), f'line {i} is not a JSON object with a "text" string')
        out.append(text)
    return out


VectorLike = ControlVector | str | os.PathLike[str]
ControlSource = (ControlSetting | VectorLike | tuple[VectorLike, float]
                 | Sequence[VectorLike | tuple[VectorLike, float]])
"""What `Engine.set_control_vector` takes: a setting, a vector or path, a (vector|path, strength) pair, or a
list of those (summed)."""


__all__ = ["ControlSource", "EngineLike", "VectorLike", "ControlSetting", "ControlVector", "ResidualCapture", "direction_from_pairs",
           "parse_layers", "read_examples", "residual_stream"]
