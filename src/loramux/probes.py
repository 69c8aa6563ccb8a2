"""Known-answer probe: fixed prompts, a fixed adapter, fixed perturbations → a table of exact losses.

A change near the adapter path (a new llama.cpp pin, a refactor of in-place writes, a scheduler
change) breaks losses long before it breaks speed. The probe scores four fixed prompts of exactly
`N_TOKENS` tokens each under seven configurations of one fixed rank-2 adapter and records the
float64 NLL sums. On one build (binding version, llama.cpp system info, backend, threads, model file)
the numbers are bit-identical run to run, so `check` demands exact equality; across builds they
differ by small offsets, so a reference from another build is refused unless a relative tolerance is
given (`probe_refs` picks among the references that ship with loramux and states the cross-build one).

Rows, in the order they are measured:

    base       no adapter
    adapter    the adapter as loaded from its file (θ)
    zero       every factor overwritten in place with zeros        must equal base exactly (CPU)
    plus_eps   θ + ε·z written in place (z: a seeded direction)
    minus_eps  θ − ε·z written in place
    restored   θ written back in place                             must equal adapter exactly (CPU)
    dropped    the adapter removed from the engine                 must equal base exactly (CPU)
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import numpy as np

from ._progress import bar
from .errors import ParameterError, ProbeMismatch

if TYPE_CHECKING:  # the engine loads llama.cpp: imported where it is used
    from .engine.runtime import Engine

FORMAT = "loramux-probe/1"
PROMPTS: tuple[str, ...] = (
    "The old lighthouse keeper climbed the spiral stairs every evening, counting each of the one "
    "hundred and twelve steps while the fog rolled in from the grey northern sea.",
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n"
    "print([fibonacci(i) for i in range(10)])",
    "Q: What is 17 multiplied by 23? A: 17 times 23 is 391. Q: What is the capital of Australia? "
    "A: The capital of Australia is Canberra.",
    "Ingredients: two cups of flour, one teaspoon of salt, three eggs, a pinch of nutmeg. Whisk the "
    "eggs, fold in the flour slowly, and let the dough rest for an hour.",
)
N_TOKENS = 32  # tokens per prompt (BOS included): truncated, or padded by repeating the prompt
RANK = 2
ADAPTER_SEED = 20240607
DIRECTION_SEED = 7
EPS = 0.01  # ±ε step, relative to each factor tensor's RMS
# Output RMS of the builtin adapter's B·A·x relative to the RMS of x: large enough to move every
# row by a clearly visible amount, small enough that the model still reads as a language model.
STRENGTH = 0.1
PROJECTIONS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
ROWS = ("base", "adapter", "zero", "plus_eps", "minus_eps", "restored", "dropped")
ROW_HELP = {
    "base": "no adapter", "adapter": "adapter θ as loaded", "zero": "factors zeroed in place",
    "plus_eps": "θ + ε·z in place", "minus_eps": "θ − ε·z in place", "restored": "θ written back",
    "dropped": "adapter removed",
}
# (row, must equal row): exact on CPU whatever the build; they are the math, not a reference.
EXACT_PAIRS = (("zero", "base"), ("restored", "adapter"), ("dropped", "base"))
BUILD_FIELDS = ("binding_version", "system_info", "backend", "threads", "model_sha256")
# Fields a reference may differ on and still be compared within a tolerance: other kernels of the same
# math. Another model file or probe setup is another experiment, never compared.
CROSS_BUILD_KEYS = tuple(f"build.{k}" for k in BUILD_FIELDS if k != "model_sha256")
PROBE_NAME = "loramux-probe"


# ------------------------------------------------------------------------------------------ inputs
def probe_tokens(tokenize: Callable[[str], list[int]], n_tokens: int = N_TOKENS) -> list[list[int]]:
    """The fixed prompts as token lists of exactly `n_tokens`: truncated, or padded deterministically
    by repeating the prompt's own tokens (BOS excluded) until the length is reached."""
    out = []
    for text in PROMPTS:
        toks = list(tokenize(text))
        body = toks[1:] if len(toks) > 1 else toks
        i = 0
        while len(toks) < n_tokens:
            toks.append(body[i % len(body)])
            i += 1
        out.append(toks[:n_tokens])
    return out


def projection_names(shapes: Mapping[str, tuple[int, ...]], n_layer: int) -> list[str]:
    """Every `blk.N.<projection>.weight` the base has, in layer order."""
    names = [f"blk.{i}.{p}.weight" for i in range(n_layer) for p in PROJECTIONS]
    return [n for n in names if n in shapes and len(shapes[n]) == 2]


def builtin_factors(shapes: Mapping[str, tuple[int, ...]], n_layer: int, seed: int = ADAPTER_SEED,
                    rank: int = RANK, strength: float = STRENGTH) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The probe's fixed adapter in PEFT layout (A (r, in), B (out, r)), from numpy's default_rng(seed).

    A ~ N(0, 1/in) and B ~ N(0, strength²/r), so B·A·x has about `strength` times the RMS of x
    on every projection whatever its width (with alpha = rank, i.e. no extra scaling).
    """
    rng = np.random.default_rng(seed)
    out = {}
    for name in projection_names(shapes, n_layer):
        n_out, n_in = shapes[name]
        a = rng.standard_normal((rank, n_in)) / math.sqrt(n_in)
        b = rng.standard_normal((n_out, rank)) * (strength / math.sqrt(rank))
        out[name] = (a.astype(np.float32), b.astype(np.float32))
    if not out:
        raise ParameterError("model", "has no blk.N.{attn_q,…,ffn_down}.weight projections for the probe adapter")
    return out


def direction(factors: Mapping[str, tuple[np.ndarray, np.ndarray]], seed: int = DIRECTION_SEED
              ) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """A fixed seeded direction z, each tensor scaled to the RMS of the factor it perturbs.

    Factors that are all zero (PEFT's B at init) get 1/sqrt(fan-in) instead, so θ ± ε·z always moves.
    """
    rng = np.random.default_rng(seed)
    out = {}
    for name in sorted(factors):
        pair = []
        for t in factors[name]:
            rms = float(np.sqrt(np.mean(np.square(t, dtype=np.float64))))
            pair.append(rng.standard_normal(t.shape) * (rms if rms > 0 else 1 / math.sqrt(t.shape[1])))
        out[name] = (pair[0], pair[1])
    return out


def _shifted(theta: Mapping[str, tuple[np.ndarray, np.ndarray]], z: Mapping[str, tuple[np.ndarray, np.ndarray]],
             eps: float) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    return {n: ((a + eps * z[n][0]).astype(np.float32), (b + eps * z[n][1]).astype(np.float32))
            for n, (a, b) in theta.items()}


def setup_fingerprint(n_tokens: int = N_TOKENS) -> dict[str, Any]:
    """What defines the probe itself; a reference made with another setup is not comparable."""
    h = hashlib.sha256()
    for p in PROMPTS:
        h.update(p.encode() + b"\0")
    return {"prompts_sha256": h.hexdigest()[:16], "n_prompts": len(PROMPTS), "tokens_per_prompt": n_tokens,
            "rank": RANK, "adapter_seed": ADAPTER_SEED, "strength": STRENGTH, "direction_seed": DIRECTION_SEED,
            "eps": EPS, "scale": 1.0}


# ------------------------------------------------------------------------------------------ result
@dataclass
class ProbeRow:
    """One configuration's losses: per-prompt float64 NLL sums, their total and the token count."""

    nll_sum: float
    tokens: int
    per_prompt: list[float]

    @property
    def loss(self) -> float:
        return self.nll_sum / max(self.tokens, 1)

    def to_dict(self) -> dict[str, Any]:
        return {"loss": self.loss, "nll_sum": self.nll_sum, "tokens": self.tokens, "per_prompt": self.per_prompt}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ProbeRow:
        return cls(float(d["nll_sum"]), int(d["tokens"]), [float(x) for x in d["per_prompt"]])


@dataclass
class ProbeComparison:
    """What a `ProbeResult.check` that passed compared: the reference, the rule and how many values."""

    reference: str
    rtol: float  # 0.0: exact equality
    values: int  # float64 sums compared: each row's NLL sum and (same build only) its per-prompt sums
    max_offset: float  # largest relative difference among them (0.0: all bit-identical)
    foreign: list[str] = field(default_factory=list)  # build fields on which the reference differs

    @property
    def exact(self) -> bool:
        return self.rtol == 0.0


@dataclass
class ProbeResult:
    """A probe run: build identity, setup, adapter, rows, within-run invariants, and when it ran."""

    build: dict[str, Any]
    setup: dict[str, Any]
    adapter: dict[str, Any]
    model: dict[str, Any]
    rows: dict[str, ProbeRow]
    loramux_version: str = ""
    violations: list[str] = field(default_factory=list)
    run: dict[str, Any] = field(default_factory=dict)

    @property
    def directional_derivative(self) -> float:
        """(L(θ+εz) − L(θ−εz)) / 2ε on the mean loss: a finite-difference slope along z."""
        return (self.rows["plus_eps"].loss - self.rows["minus_eps"].loss) / (2 * self.setup["eps"])

    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, "build": self.build, "loramux_version": self.loramux_version,
                "model": self.model, "setup": self.setup, "adapter": self.adapter,
                "rows": {k: r.to_dict() for k, r in self.rows.items()},
                "directional_derivative": self.directional_derivative,
                "violations": self.violations, "run": self.run}

    def to_json(self) -> str:
        # json writes floats with repr(), which round-trips float64 exactly: references stay bit-exact.
        return json.dumps(self.to_dict(), indent=2) + "\n"

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], source: str = "reference") -> ProbeResult:
        if d.get("format") != FORMAT:
            raise ProbeMismatch(f"{source}: not a probe reference (format {d.get('format')!r}, expected {FORMAT!r})",
                                hint="make one with `loramux probe --write REF.json`")
        try:
            rows = {k: ProbeRow.from_dict(v) for k, v in d["rows"].items()}
            return cls(dict(d["build"]), dict(d["setup"]), dict(d["adapter"]), dict(d.get("model", {})), rows,
                       str(d.get("loramux_version", "")), list(d.get("violations", [])), dict(d.get("run", {})))
        except (KeyError, TypeError, ValueError) as e:
            raise ProbeMismatch(f"{source}: malformed probe reference ({type(e).__name__}: {e})",
                                hint="make a new one with `loramux probe --write REF.json`") from None

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> ProbeResult:
        """Read a reference written by `write` (or `loramux probe --write`)."""
        p = Path(path)
        try:
            data = json.loads(p.read_text())
        except FileNotFoundError:
            raise ParameterError("check", f"reference {p} does not exist",
                                 hint="make one with `loramux probe --write REF.json`") from None
        except (OSError, json.JSONDecodeError) as e:
            raise ProbeMismatch(f"{p}: cannot read the probe reference: {e}") from None
        return cls.from_dict(data, str(p))

    def write(self, path: str | os.PathLike[str]) -> Path:
        """Write this run as a reference JSON (atomically)."""
        from .gguf_io import atomic_path

        with atomic_path(path) as tmp:
            Path(tmp).write_text(self.to_json())
        return Path(path)

    # -- comparison ---------------------------------------------------------------------------
    def foreign_keys(self, ref: ProbeResult) -> list[str]:
        """`build.<field>` and `setup.<field>` keys on which `ref` differs from this run (empty: same build)."""
        out = [f"build.{k}" for k in BUILD_FIELDS if self.build.get(k) != ref.build.get(k)]
        return out + [f"setup.{k}" for k in sorted(set(self.setup) | set(ref.setup))
                      if self.setup.get(k) != ref.setup.get(k)]

    def foreign_fields(self, ref: ProbeResult) -> list[str]:
        """Build-identity and setup fields on which `ref` differs from this run, described (empty: comparable)."""
        out = []
        for key in self.foreign_keys(ref):
            part, k = key.split(".", 1)
            mine, theirs = getattr(self, part).get(k), getattr(ref, part).get(k)
            out.append(f"{key}: reference {theirs!r}, this run {mine!r}")
        return out

    def moved_rows(self, ref: ProbeResult, rtol: float = 0.0, per_prompt: bool = True) -> dict[str, str]:
        """Rows whose losses differ from `ref` (exactly, or beyond relative `rtol`): name → description.
        `per_prompt` False compares each row's total NLL only (the per-prompt sums are still named)."""
        moved = {}
        for name in ROWS:
            mine, theirs = self.rows.get(name), ref.rows.get(name)
            if mine is None or theirs is None:
                moved[name] = "missing in the " + ("reference" if theirs is None else "run")
                continue
            pairs = [(theirs.nll_sum, mine.nll_sum)] + list(zip(theirs.per_prompt, mine.per_prompt))
            same_shape = theirs.tokens == mine.tokens and len(theirs.per_prompt) == len(mine.per_prompt)
            if same_shape and all(_close(a, b, rtol) for a, b in (pairs if per_prompt else pairs[:1])):
                continue
            d = mine.loss - theirs.loss
            rel = abs(d) / abs(theirs.loss) if theirs.loss else math.inf
            which = [f"{i} (NLL Δ {b - a:+.3e})" for i, (a, b) in enumerate(pairs[1:]) if not _close(a, b, rtol)]
            moved[name] = (f"loss {theirs.loss!r} → {mine.loss!r} (Δ {d:+.3e}, relative {rel:.2e}); "
                           f"prompts moved: {', '.join(which) or 'none'}")
        return moved

    def check(self, ref: ProbeResult | str | os.PathLike[str], rtol: float = 0.0) -> ProbeComparison:
        """Compare this run with `ref` and say what was compared; raise ProbeMismatch if `ref` cannot be
        compared, if any row moved, or if this run broke a within-run invariant.

        `rtol` 0 demands exact equality of every row's NLL sum and per-prompt sums (one build is
        bit-identical run to run) and refuses a reference from another build. With `rtol` > 0, a
        reference that differs only in build fields (binding, system info, backend, threads) is compared
        within that relative tolerance on each row's total NLL (per-prompt sums of ~31 tokens move by
        percents between builds: one token's rounding flip); a reference for another model file or
        probe setup is refused whatever the tolerance.
        """
        if not (rtol >= 0 and math.isfinite(rtol)):
            raise ParameterError("rtol", f"must be a finite number >= 0, got {rtol!r}")
        ref_path = None
        if not isinstance(ref, ProbeResult):
            ref_path = str(ref)
            ref = ProbeResult.load(ref)
        where = ref_path or "the reference"
        keys = self.foreign_keys(ref)
        never = [k for k in keys if k not in CROSS_BUILD_KEYS]
        if never or (keys and rtol == 0):
            _refuse(where, self.foreign_fields(ref), tolerable=not never)
        moved = self.moved_rows(ref, rtol, per_prompt=not keys)
        if moved or self.violations:
            tol = ("exact equality required on one build" if rtol == 0 else
                   f"relative tolerance {rtol:g}" + (" across builds" if keys else ""))
            problems = [f"{k} ({ROW_HELP.get(k, k)}): {v}" for k, v in moved.items()] + self.violations
            if ref.adapter.get("sha256") != self.adapter.get("sha256"):
                problems.append(f"note: the adapter differs from the reference's "
                                f"({ref.adapter.get('file')} vs {self.adapter.get('file')})")
            e = ProbeMismatch(f"probe differs from {where} ({len(moved)} row(s) moved, {tol}; "
                              f"{len(self.violations)} invariant(s) broken)", problems=problems,
                              hint="something on the forward path changed the numbers; if the change is "
                                   "intended, write a new reference with --write", rows=moved)
            raise e
        n = 1 if keys else None  # across builds: the row totals only
        pairs = [(a, b) for name in ROWS for a, b in zip([ref.rows[name].nll_sum, *ref.rows[name].per_prompt][:n],
                                                            [self.rows[name].nll_sum, *self.rows[name].per_prompt][:n])]
        offset = max(abs(a - b) / max(abs(a), abs(b)) if a != b else 0.0 for a, b in pairs)
        return ProbeComparison(where, rtol, len(pairs), offset, self.foreign_fields(ref))

    # -- rendering ----------------------------------------------------------------------------
    def table(self, ref: ProbeResult | None = None, markdown: bool = False) -> str:
        """The rows as a terminal (or markdown) table; with `ref`, the reference and the difference."""
        head = ["row", "what", "mean NLL", "Δ vs base", "NLL sum", "tokens"]
        if ref is not None:
            head += ["reference", "Δ vs reference"]
        base = self.rows["base"].loss
        body = []
        for name in ROWS:
            r = self.rows[name]
            line = [name, ROW_HELP[name], f"{r.loss:.12f}", f"{r.loss - base:+.3e}", f"{r.nll_sum:.9f}", str(r.tokens)]
            if ref is not None:
                rr = ref.rows.get(name)
                line += ([f"{rr.loss:.12f}", "0 (exact)" if rr.nll_sum == r.nll_sum else f"{r.loss - rr.loss:+.3e}"]
                         if rr else ["—", "—"])
            body.append(line)
        foot = [f"directional derivative along z: {self.directional_derivative:+.6e} (central difference, ε={self.setup['eps']})",
                "invariants: " + ("all hold (" + ", ".join(f"{a} == {b}" for a, b in EXACT_PAIRS) + ", exact)"
                                  if not self.violations else "; ".join(self.violations))]
        b = self.build
        ident = (f"build: llama-cpp-python {b['binding_version']}, backend {b['backend']}, {b['threads']} threads, "
                 f"model {self.model.get('file', '?')} sha256 {str(b['model_sha256'])[:12]}…, "
                 f"adapter {self.adapter.get('file')}, loramux {self.loramux_version}")
        if markdown:
            lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
            lines += ["| " + " | ".join(f"`{c}`" if i == 0 else c for i, c in enumerate(row)) + " |" for row in body]
            return "\n".join([f"**{ident}**", "", *lines, "", *(f"- {f}" for f in foot)]) + "\n"
        widths = [max(len(h), *(len(row[i]) for row in body)) for i, h in enumerate(head)]
        fmt = "  ".join(f"{{:<{w}}}" if i < 2 else f"{{:>{w}}}" for i, w in enumerate(widths))
        lines = [fmt.format(*head), fmt.format(*("-" * w for w in widths))] + [fmt.format(*row) for row in body]
        return "\n".join([ident, *lines, *foot]) + "\n"


def _close(a: float, b: float, rtol: float) -> bool:
    if rtol == 0:
        return a == b
    return abs(a - b) <= rtol * max(abs(a), abs(b))


def _refuse(where: str, foreign: list[str], tolerable: bool) -> NoReturn:
    """Raise the ProbeMismatch that refuses a reference (`.foreign` set, `.rows` empty)."""
    hint = ("make a reference on this build with `loramux probe --write REF.json` "
            "(keep one reference per build and thread count)")
    if tolerable:
        hint += ", or compare across builds with a relative tolerance (`--rtol`, see docs/probe.md)"
    e = ProbeMismatch(
        f"refusing to compare against {where}: it was made by a different build or probe setup. "
        "Losses differ between builds by small offsets (other kernels, thread splits, model file), "
        "so a probe compares only within one build" + ("" if tolerable else " (another model file or "
                                                       "probe setup is never comparable)"),
        problems=foreign, hint=hint, foreign=foreign)
    raise e


# ------------------------------------------------------------------------------------------ engine
@contextmanager
def open_engine(engine_or_model_path: Engine | str | os.PathLike[str] | None = None, *, threads: int | None = None,
                n_gpu_layers: int = 0, n_ctx: int = 256, use_mmap: bool = True) -> Iterator[Engine]:
    """Use the Engine given, or load one (default model when None) with the probe's settings and close it."""
    from .engine.runtime import Engine

    with Engine.use(engine_or_model_path, n_ctx=n_ctx, n_threads=threads, n_gpu_layers=n_gpu_layers,
                    use_mmap=use_mmap) as eng:
        yield eng


def engine_threads(eng: Engine) -> int:
    """Threads the engine's evaluation context runs with (what the losses depend on)."""
    return int(eng.n_threads)


def build_identity(eng: Engine) -> dict[str, Any]:
    """What the probe's numbers depend on: the binding, llama.cpp's CPU features, backend, threads, model."""
    from . import _native as N

    gpu_layers = int(getattr(eng.model, "n_gpu_layers", 0) or 0)
    return {"binding_version": N.binding_version(), "system_info": N.system_info().strip(),
            "backend": "cpu" if gpu_layers <= 0 else f"gpu ({gpu_layers} layers offloaded)",
            "threads": engine_threads(eng), "model_sha256": eng.model.sha256}


@contextmanager
def probe_adapter(eng: Engine, lora: str | os.PathLike[str] | None, name: str = PROBE_NAME) -> Iterator[Any]:
    """Load the probe's adapter into `eng` under its own name: the builtin one (written to a temp GGUF),
    a file/URL, or a copy of an adapter already loaded in `eng` by that name. Unloaded afterwards."""
    from .gguf_io import write_adapter

    with tempfile.TemporaryDirectory(prefix="loramux-probe-") as tmp:
        if lora is None:
            m = eng.model
            src: str | Path = write_adapter(Path(tmp) / "probe-builtin.gguf", m.architecture,
                                            builtin_factors(m.tensor_shapes, m.n_layer), float(RANK), name="probe")
        elif str(lora) in eng.adapters and not Path(lora).exists():
            src = eng.adapter(str(lora)).save(Path(tmp) / f"{lora}.gguf")  # its live factors, not the file
        else:
            src = lora
        adapter = eng.load_lora(src, name=name)
        try:
            yield adapter
        finally:
            if name in eng.adapters and eng.adapters[name] is adapter:
                eng.remove_lora(name)


# ------------------------------------------------------------------------------------------ probe
def probe(engine_or_model_path: Engine | str | os.PathLike[str] | None = None, lora: str | os.PathLike[str] | None = None, *,
          threads: int | None = None, n_gpu_layers: int = 0, check: Any = None, write: Any = None,
          rtol: float = 0.0, progress: bool | None = None, use_mmap: bool = True) -> ProbeResult:
    """Run the known-answer probe and return its table.

    `engine_or_model_path`: an Engine (left open; its default set and control vector are not used),
    a base GGUF path, or None for the embedded default model. `lora`: the adapter to probe with
    (default: the builtin seeded rank-2 adapter over every projection). `check`: a reference (path or
    ProbeResult) to compare against — raises ProbeMismatch on any difference. `write`: save the result.
    """
    t0 = time.perf_counter()
    with open_engine(engine_or_model_path, threads=threads, n_gpu_layers=n_gpu_layers, use_mmap=use_mmap) as eng:
        toks = probe_tokens(eng.tokenize)
        steps = bar(len(ROWS), "probe", progress, unit="row")
        rows: dict[str, ProbeRow] = {}

        def score(row: str, loras: dict[str, float]) -> None:
            sums, count = [], 0
            for t in toks:
                s, c = eng.loss_sum([t], loras=loras, control=None)
                sums.append(s)
                count += c
            total = 0.0
            for s in sums:  # fixed order: the same float64 sum every run
                total += s
            rows[row] = ProbeRow(total, count, sums)
            steps.update(1)

        score("base", {})
        with probe_adapter(eng, lora) as ad:
            on = {ad.name: 1.0}
            score("adapter", on)
            theta = ad.all_factors()
            ad.set_factors_multi({n: (np.zeros_like(a), np.zeros_like(b)) for n, (a, b) in theta.items()})
            score("zero", on)
            z = direction(theta)
            ad.set_factors_multi(_shifted(theta, z, EPS))
            score("plus_eps", on)
            ad.set_factors_multi(_shifted(theta, z, -EPS))
            score("minus_eps", on)
            ad.set_factors_multi(theta)
            score("restored", on)
            adapter_info = _adapter_info(ad, lora, theta)
        score("dropped", {})
        steps.close()
        build = build_identity(eng)
        model = {"file": eng.model.path.name, "architecture": eng.model.architecture,
                 "n_layer": eng.model.n_layer, "n_vocab": eng.model.n_vocab}
    from . import __version__

    result = ProbeResult(build, setup_fingerprint(), adapter_info, model, rows, __version__)
    result.violations = _violations(result, zero_adapter=adapter_info["all_zero"])
    result.run = {"timestamp": datetime.now(UTC).isoformat(timespec="seconds"),
                  "elapsed_s": round(time.perf_counter() - t0, 3)}
    if write is not None:
        result.write(write)
    if check is not None:
        result.check(check, rtol)
    return result


def _adapter_info(ad: Any, lora: Any, theta: Mapping[str, tuple[np.ndarray, np.ndarray]]) -> dict[str, Any]:
    return {"file": "builtin" if lora is None else Path(str(lora)).name, "sha256": ad.sha256,
            "rank": ad.rank, "alpha": ad.alpha, "dtype": ad.dtype, "n_factors": ad.n_factors,
            "all_zero": all(not a.any() and not b.any() for a, b in theta.values())}


def _violations(r: ProbeResult, zero_adapter: bool) -> list[str]:
    """Within-run invariants. Exact on CPU; on a GPU backend only reported when they are not even close."""
    out = []
    cpu = r.build["backend"] == "cpu"
    for name, row in r.rows.items():
        if not all(math.isfinite(x) for x in [row.nll_sum, *row.per_prompt]):
            out.append(f"{name}: loss is not finite ({row.nll_sum})")
    for a, b in EXACT_PAIRS:
        x, y = r.rows[a].nll_sum, r.rows[b].nll_sum
        if (x != y) if cpu else not _close(x, y, 1e-4):
            out.append(f"invariant {a} == {b} broken: {x!r} vs {y!r} (Δ {x - y:+.3e})")
    if not zero_adapter:
        # The adapter and the in-place writes must reach the graph; silently ignored adapters give base.
        if r.rows["adapter"].nll_sum == r.rows["base"].nll_sum:
            out.append("invariant adapter != base broken: the adapter has no effect on the loss")
        if r.rows["plus_eps"].nll_sum == r.rows["minus_eps"].nll_sum:
            out.append("invariant plus_eps != minus_eps broken: in-place writes have no effect on the loss")
    return out


__all__ = ["probe", "ProbeResult", "ProbeRow", "ProbeComparison", "PROMPTS", "N_TOKENS", "builtin_factors",
           "direction", "probe_tokens", "build_identity", "open_engine"]
