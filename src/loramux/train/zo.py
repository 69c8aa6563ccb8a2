"""Forward-only (zeroth-order) LoRA fine-tuning: MeZO-style two-sided SPSA through in-place writes.

llama.cpp cannot backpropagate through a quantized model, but it evaluates losses fast, and a loaded
adapter's factors can be rewritten in place in well under a millisecond. One step:

1. draw a step seed from the master generator (seeded by ``seed``) and a batch from a seeded shuffle;
2. regenerate z from the step seed (standard normal, one array per factor, ``factor_names()`` order);
3. write θ+εz, score the batch (L+); write θ−εz, score it again (L−);
4. g = (L+ − L−) / 2ε, the loss's slope along z; θ ← θ − lr·ĝ·z, written back in place, where ĝ is
   g over its running RMS (``normalize``, the default) or g itself (plain MeZO-SGD), and lr decays
   linearly to 0 (``schedule="linear"``, the default) or stays constant.

θ is an fp32 master copy of every factor; losses are mean token NLLs summed in float64. The same seed
and data give the same loss sequence to the last digit (llama.cpp's CPU decode is deterministic for
one sequence at a time with the same threads), and a run resumed from a checkpoint continues it
exactly. A non-finite loss (or update) puts the last good factors back and raises TrainingError.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from .._progress import Bar
from .._progress import bar as progress_bar
from ..errors import FactorError, ParameterError, TrainingError
from ..gguf_io import atomic_path, read_adapter_factors, write_adapter
from .data import DataArg, Example, digest, load_examples

if TYPE_CHECKING:  # the engine loads llama.cpp: imported where it is used
    from ..engine.runtime import Engine

Factors = dict[str, tuple[np.ndarray, np.ndarray]]
DEFAULT_TARGETS = ("attn_q", "attn_v")
CHECKPOINT_FORMAT = "loramux-zo-checkpoint"
_log = logging.getLogger("loramux.train")
#: Settings a resumed run must share with its checkpoint: they decide the loss sequence.
_TRAJECTORY = ("rank", "alpha", "targets", "batch", "lr", "eps", "seed", "eval_every", "schedule", "normalize")
#: Memory of the running mean of g² used by `normalize` (about 20 steps).
RMS_BETA = 0.95


@dataclass(frozen=True)
class ZOConfig:
    """Hyper-parameters of a zeroth-order run (see `train_zo`)."""

    rank: int = 8
    alpha: float | None = None  # None: alpha = rank, so the delta is exactly B @ A
    targets: tuple[str, ...] = DEFAULT_TARGETS
    steps: int = 200
    batch: int = 2
    lr: float = 1e-2
    eps: float = 2e-2
    seed: int = 0
    eval_every: int = 20
    checkpoint_every: int = 0
    schedule: str = "linear"  # lr decays linearly to 0 at `steps`; "constant" keeps it
    normalize: bool = True  # divide g by its running RMS (see `ZOTrainer._coef`); False: plain MeZO-SGD

    def lr_at(self, step: int) -> float:
        """Learning rate of step `step` (1-based)."""
        if self.schedule == "constant" or self.steps <= 0:
            return self.lr
        return self.lr * max(0.0, 1.0 - (step - 1) / self.steps)

    def validate(self) -> ZOConfig:
        """Raise ParameterError naming the first bad setting; return self with alpha filled in."""
        checks = [("rank", self.rank >= 1, "must be ≥ 1"), ("steps", self.steps >= 0, "must be ≥ 0"),
                  ("batch", self.batch >= 1, "must be ≥ 1"),
                  ("lr", math.isfinite(self.lr) and self.lr > 0, "must be a positive number"),
                  ("eps", math.isfinite(self.eps) and self.eps > 0, "must be a positive number"),
                  ("eval_every", self.eval_every >= 0, "must be ≥ 0 (0: evaluate only at the start and end)"),
                  ("checkpoint_every", self.checkpoint_every >= 0, "must be ≥ 0 (0: no checkpoints)"),
                  ("targets", bool(self.targets), "name at least one projection, e.g. attn_q,attn_v"),
                  ("schedule", self.schedule in ("linear", "constant"), "must be 'linear' or 'constant'")]
        if self.alpha is not None:
            checks.append(("alpha", math.isfinite(self.alpha) and self.alpha > 0, "must be a positive number"))
        for name, ok, msg in checks:
            if not ok:
                raise ParameterError(name, f"{msg} (got {getattr(self, name)!r})")
        alpha = float(self.rank if self.alpha is None else self.alpha)
        return ZOConfig(**{**asdict(self), "alpha": alpha, "targets": tuple(self.targets)})


@dataclass
class TrainResult:
    """What a run produced: files, losses, the log and where the time went."""

    out: Path  # best factors (by held-out loss; the last ones without eval data)
    last: Path | None  # last factors when they differ in meaning from `out` (eval data given)
    name: str  # the adapter's name in the engine
    steps: int  # steps completed (including those before a resume)
    n_params: int
    losses: list[float]  # per step, (L+ + L−) / 2 on that step's batch
    eval_history: list[tuple[int, float]]  # (step, held-out mean token NLL)
    best_step: int | None
    best_eval_loss: float | None
    log: list[dict[str, Any]]
    write_seconds: float  # in-place factor writes (validation + copy into the live tensors)
    forward_seconds: float  # the two batch losses of every step
    other_seconds: float  # drawing z and the fp32 arithmetic
    eval_seconds: float
    wall_seconds: float
    checkpoints: list[Path] = field(default_factory=list)
    log_file: Path | None = None
    plot_file: Path | None = None  # None when matplotlib is missing

    @property
    def initial_eval_loss(self) -> float | None:
        return self.eval_history[0][1] if self.eval_history else None

    @property
    def final_eval_loss(self) -> float | None:
        return self.eval_history[-1][1] if self.eval_history else None

    @property
    def write_share(self) -> float:
        """Fraction of the step time (writes + forwards + other) spent writing factors."""
        total = self.write_seconds + self.forward_seconds + self.other_seconds
        return self.write_seconds / total if total else 0.0


def init_factors(shapes: dict[str, tuple[int, int]], rank: int, seed: int) -> Factors:
    """PEFT-style start: A ~ U(±1/√in) (kaiming-uniform with a=√5), B = 0, so step 0 is the base."""
    rng = np.random.default_rng([seed, 0x10A])  # its own stream, apart from the step seeds
    out = {}
    for name, (n_out, n_in) in shapes.items():
        bound = 1.0 / math.sqrt(n_in)
        a = rng.uniform(-bound, bound, size=(rank, n_in)).astype(np.float32)
        out[name] = (a, np.zeros((n_out, rank), np.float32))
    return out


def target_shapes(model: Any, targets: Sequence[str]) -> dict[str, tuple[int, int]]:
    """numpy (out, in) shapes of ``blk.N.<proj>.weight`` for every block and every projection named."""
    shapes = model.tensor_shapes
    known = sorted({n.split(".")[2] for n in shapes if n.startswith("blk.") and n.endswith(".weight")
                    and len(shapes[n]) == 2})
    unknown = [t for t in targets if t not in known]
    if unknown:
        raise ParameterError("targets", f"{', '.join(unknown)} not a projection of this model",
                             hint=f"choose from {', '.join(known)}")
    out = {}
    for i in range(model.n_layer):
        for t in targets:
            name = f"blk.{i}.{t}.weight"
            if name in shapes:
                n_out, n_in = shapes[name]
                out[name] = (int(n_out), int(n_in))
    return out


class ZOTrainer:
    """The state of one zeroth-order run on an engine; `train_zo` drives it."""

    def __init__(self, engine: Engine, train: list[Example], evals: list[Example], out: Path,
                 cfg: ZOConfig, name: str) -> None:
        self.engine, self.train, self.evals, self.out, self.cfg, self.name = engine, train, evals, out, cfg, name
        if cfg.batch > len(train):
            raise ParameterError("batch", f"is {cfg.batch} but the training data has {len(train)} examples",
                                 hint="lower --batch or add examples")
        self.rng = np.random.default_rng(cfg.seed)
        self.order: list[int] = []
        self.pos = 0
        self.step = 0
        self.g2 = 0.0  # running mean of g² (bias-corrected when used)
        self.rows: list[dict[str, Any]] = []
        self.eval_history: list[tuple[int, float]] = []
        self.best: Factors | None = None
        self.best_loss: float | None = None
        self.best_step: int | None = None
        self.timing = {"write": 0.0, "forward": 0.0, "other": 0.0, "eval": 0.0, "wall": 0.0}
        self.checkpoints: list[Path] = []
        self.log_file: Path | None = None
        self.plot_file: Path | None = None
        self.master: Factors = {}
        self.names: list[str] = []
        self.adapter: Any = None

    # -- adapter ---------------------------------------------------------------------------------
    def start(self, factors: Factors) -> None:
        """Load `factors` as a fresh adapter named `self.name` and make them the master copy."""
        model = self.engine.model
        with tempfile.TemporaryDirectory(prefix="loramux-zo-") as tmp:
            path = Path(tmp) / f"{self.name}.gguf"
            write_adapter(path, model.architecture, factors, self.cfg.alpha, dtype="f32", name=self.name)
            self.adapter = self.engine.load_lora(path, name=self.name)
        self.names = self.adapter.factor_names()
        self.master = {n: (factors[n][0].astype(np.float32), factors[n][1].astype(np.float32))
                       for n in self.names}

    @property
    def n_params(self) -> int:
        return sum(a.size + b.size for a, b in self.master.values())

    @contextlib.contextmanager
    def _clock(self, key: str) -> Iterator[None]:
        """Add the block's wall time to timing[key] (the per-step breakdown in the log)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.timing[key] += time.perf_counter() - t0

    def _write(self, factors: Factors) -> None:
        with self._clock("write"):
            self.adapter.set_factors_multi(factors)

    def _loss_at(self, z: Factors, coef: float, batch: Sequence[Example]) -> float:
        """Loss on `batch` with the factors moved to θ + coef·z."""
        with self._clock("other"):
            shifted = self._shifted(z, coef)
        self._write(shifted)
        with self._clock("forward"):
            return self._loss(batch)

    def _loss(self, examples: Sequence[Example]) -> float:
        total, count = self.engine.loss_sum([e.tokens for e in examples], masks=[e.mask for e in examples],
                                            loras={self.name: 1.0}, control=None)
        return float(total) / max(int(count), 1)

    # -- one step ----------------------------------------------------------------------------------
    def _next_batch(self) -> list[Example]:
        b = self.cfg.batch
        if self.pos + b > len(self.order):  # new epoch: reshuffle, drop the short tail
            self.order = [int(i) for i in self.rng.permutation(len(self.train))]
            self.pos = 0
        idx = self.order[self.pos:self.pos + b]
        self.pos += b
        return [self.train[i] for i in idx]

    def _noise(self, step_seed: int) -> Factors:
        rng = np.random.default_rng(step_seed)
        return {n: (rng.standard_normal(self.master[n][0].shape, dtype=np.float32),
                    rng.standard_normal(self.master[n][1].shape, dtype=np.float32)) for n in self.names}

    def _shifted(self, z: Factors, coef: float) -> Factors:
        c = np.float32(coef)
        return {n: (a + c * z[n][0], b + c * z[n][1]) for n, (a, b) in self.master.items()}

    def do_step(self) -> dict[str, Any]:
        """One SPSA step; returns its log row. Non-finite → factors restored, TrainingError."""
        t_start = time.perf_counter()
        before = dict(self.timing)
        step = self.step + 1
        batch = self._next_batch()
        with self._clock("other"):
            z = self._noise(int(self.rng.integers(0, 2**63 - 1)))
        lp = self._loss_at(z, self.cfg.eps, batch)
        lm = self._loss_at(z, -self.cfg.eps, batch)
        with self._clock("other"):
            g = (lp - lm) / (2.0 * self.cfg.eps)
            lr = self.cfg.lr_at(step)
            coef = self._coef(g, step) if math.isfinite(g) else math.nan
            new = self._shifted(z, -lr * coef) if math.isfinite(coef) else None
            ok = new is not None and all(np.isfinite(a).all() and np.isfinite(b).all() for a, b in new.values())
        refused = None
        if ok:
            try:  # restore and update in one write: θ ← θ − lr·g·z is what the next forward must see
                self._write(new)
            except FactorError as e:  # finite, but past the delta bound every write is held to
                ok, refused = False, e
        if not ok:
            self._write(self.master)  # restore the last good factors before saying anything
            what = f"loss L+={lp!r}, L-={lm!r}" if not (math.isfinite(lp) and math.isfinite(lm)) else \
                f"update lr·g = {lr * g!r} overflowed the factors (or the bound on their delta)"
            raise TrainingError(f"step {step}: non-finite {what}; the last good factors (step {self.step}) "
                                "were restored", step=step,
                                hint="lower --lr (or --eps); resume from the last checkpoint if you have one") from refused
        self.master = new
        self.step = step
        if self.cfg.normalize:
            self.g2 = RMS_BETA * self.g2 + (1.0 - RMS_BETA) * g * g
        row = {"step": step, "loss_plus": lp, "loss_minus": lm, "loss": (lp + lm) / 2.0, "grad": g, "lr": lr,
               "eval_loss": None}
        for k in ("write", "forward", "other"):
            row[f"{k}_s"] = self.timing[k] - before[k]
        row["step_s"] = time.perf_counter() - t_start
        return row

    def _coef(self, g: float, step: int) -> float:
        """g itself, or g over its running RMS (g² averaged with this step's, bias-corrected as in Adam).

        Normalising keeps the size of a step along z near lr whatever the scale of g: on a quantized
        model g grows as the adapter learns and rare large values (noise, sharp curvature) would
        otherwise kick the factors far enough to diverge.
        """
        if not self.cfg.normalize:
            return g
        g2 = RMS_BETA * self.g2 + (1.0 - RMS_BETA) * g * g
        rms = math.sqrt(g2 / (1.0 - RMS_BETA ** step))
        return g / rms if rms > 0 else 0.0

    # -- evaluation and the best factors -------------------------------------------------------------
    def evaluate(self) -> float | None:
        """Held-out loss of the current factors; keeps and saves them if they are the best so far."""
        if not self.evals:
            return None
        with self._clock("eval"):
            loss = self._loss(self.evals)
        self.eval_history.append((self.step, loss))
        if not math.isfinite(loss):
            return loss
        if self.best_loss is None or loss < self.best_loss:
            self.best_loss, self.best_step = loss, self.step
            self.best = {n: (a.copy(), b.copy()) for n, (a, b) in self.master.items()}
            self._save(self.out, self.best)
        return loss

    def _save(self, path: Path, factors: Factors) -> Path:
        return write_adapter(path, self.engine.model.architecture, factors, self.cfg.alpha, dtype="f32",
                             name=self.name)

    # -- checkpoints ---------------------------------------------------------------------------------
    def checkpoint(self, data_sha: str, eval_sha: str) -> Path:
        """Write ``OUT.ckpt-STEP.json`` (+ the master and best factors as adapter GGUFs)."""
        stem = self.out.with_suffix("") if self.out.suffix == ".gguf" else self.out
        base = Path(f"{stem}.ckpt-{self.step:06d}")
        fac = self._save(Path(f"{base}.gguf"), self.master)
        best = self._save(Path(f"{base}.best.gguf"), self.best) if self.best is not None else None
        state = {"format": CHECKPOINT_FORMAT, "version": 1, "step": self.step,
                 "config": _config_json(self.cfg), "data_sha256": data_sha, "eval_sha256": eval_sha,
                 "model": _model_json(self.engine.model), "rng": self.rng.bit_generator.state,
                 "order": self.order, "pos": self.pos, "g2": self.g2, "best_loss": self.best_loss,
                 "best_step": self.best_step,
                 "eval_history": self.eval_history, "timing": self.timing, "log": self.rows,
                 "factors": fac.name, "best_factors": best.name if best else None}
        path = Path(f"{base}.json")
        with atomic_path(path) as tmp:
            tmp.write_text(json.dumps(state, indent=1))
        self.checkpoints.append(path)
        return path

    def restore(self, path: Path, data_sha: str, eval_sha: str) -> None:
        """Continue from a checkpoint written by `checkpoint` (same data and trajectory settings)."""
        state = read_checkpoint(path)
        problems = []
        saved = state["config"]
        mine = _config_json(self.cfg)
        keys = _TRAJECTORY + (("steps",) if self.cfg.schedule != "constant" else ())
        for k in keys:
            if saved.get(k) != mine[k]:
                problems.append(f"{k}: checkpoint has {saved.get(k)!r}, this run {mine[k]!r}")
        if state.get("data_sha256") != data_sha:
            problems.append("the training data differs from the checkpoint's (tokens or masks)")
        if state.get("eval_sha256") != eval_sha:
            problems.append("the eval data differs from the checkpoint's")
        if state.get("model") != _model_json(self.engine.model):
            problems.append(f"model: checkpoint was made on {state.get('model')}")
        if problems:
            raise TrainingError(f"{path}: cannot resume this run from it", problems=problems,
                                hint="resume with the same model, data and settings (--steps may grow only "
                                     "with --schedule constant: the linear schedule depends on it)")
        self.start(read_adapter_factors(path.parent / state["factors"]))
        if state.get("best_factors"):
            best = read_adapter_factors(path.parent / state["best_factors"])
            self.best = {n: best[n] for n in self.names}
        self.rng.bit_generator.state = state["rng"]
        self.order, self.pos, self.step = list(state["order"]), int(state["pos"]), int(state["step"])
        self.g2 = float(state.get("g2", 0.0))
        self.best_loss, self.best_step = state["best_loss"], state["best_step"]
        self.eval_history = [(int(s), float(v)) for s, v in state["eval_history"]]
        self.rows = list(state["log"])
        self.timing.update(state["timing"])


def read_checkpoint(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Load a checkpoint's JSON (``.json``, or its ``.gguf`` sibling's name) and check its format."""
    p = Path(path)
    if p.suffix == ".gguf":
        p = p.with_name(p.name.removesuffix(".best.gguf").removesuffix(".gguf") + ".json")
    try:
        state = json.loads(p.read_text())
    except FileNotFoundError as e:
        raise TrainingError(f"checkpoint {p} not found", hint="pass the OUT.ckpt-STEP.json a run wrote") from e
    except (OSError, json.JSONDecodeError) as e:
        raise TrainingError(f"checkpoint {p} is unreadable: {e}") from e
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        raise TrainingError(f"{p} is not a loramux zo checkpoint")
    missing = [k for k in ("step", "config", "rng", "order", "pos", "log", "factors") if k not in state]
    if missing:
        raise TrainingError(f"checkpoint {p} is incomplete", problems=[f"missing {k!r}" for k in missing])
    return state


def _config_json(cfg: ZOConfig) -> dict[str, Any]:
    d = asdict(cfg)
    d["targets"] = list(cfg.targets)
    return d


def _model_json(model: Any) -> dict[str, Any]:
    return {"name": model.name, "architecture": model.architecture, "n_layer": int(model.n_layer),
            "n_embd": int(model.n_embd), "n_vocab": int(model.n_vocab)}


def train_zo(engine_or_model: Engine | str | os.PathLike[str] | None, data: DataArg, out: str | os.PathLike[str], *,
             eval_data: DataArg | None = None, name: str | None = None, resume: str | os.PathLike[str] | None = None,
             log: str | os.PathLike[str] | None = None, plot: str | os.PathLike[str] | None = None,
             progress: bool = True, callback: Callable[[dict[str, Any]], bool | None] | None = None,
             n_ctx: int = 2048, n_threads: int | None = None, **hyper: Any) -> TrainResult:
    """Train a LoRA adapter forward-only (MeZO-style SPSA) and write it to `out`.

    engine_or_model: an Engine (the adapter stays loaded in it as `name`, holding the result), or a base
    GGUF path / None for the default model (an engine is made with `n_ctx`, `n_threads` and closed).
    data / eval_data: JSONL path or records (see loramux.train.data). hyper: ZOConfig fields — rank,
    alpha, targets, steps, batch, lr, eps, seed, eval_every, checkpoint_every, schedule.
    Writes `out` (best held-out factors, or the last ones without eval data), ``out.last.gguf`` (last
    factors, with eval data), checkpoints ``out.ckpt-STEP.json/.gguf`` every `checkpoint_every` steps and
    at the end, the log (.csv or .json) and a PNG loss curve (needs matplotlib).
    `callback(row)` sees every step's log row; returning False stops the run early.

    A non-finite loss or update restores the last good factors (live and in `out`) and raises
    TrainingError with ``.step`` and ``.result`` (the TrainResult so far); Ctrl-C saves the same way.
    """
    unknown = sorted(set(hyper) - set(ZOConfig.__dataclass_fields__))
    if unknown:
        raise ParameterError(unknown[0], f"unknown setting; known: {', '.join(ZOConfig.__dataclass_fields__)}")
    if "targets" in hyper and isinstance(hyper["targets"], str):
        hyper["targets"] = tuple(t.strip() for t in hyper["targets"].split(",") if t.strip())
    cfg = ZOConfig(**hyper).validate()
    out_path = Path(out)
    if out_path.suffix != ".gguf":
        raise ParameterError("out", f"{out_path} should end in .gguf (it is an adapter GGUF)")
    from ..engine.runtime import Engine

    with Engine.use(engine_or_model, n_ctx=n_ctx, n_threads=n_threads) as engine:
        return _run(engine, data, eval_data, out_path, cfg, name or out_path.stem, resume, log, plot,
                    progress, callback)


def _run(engine: Engine, data: DataArg, eval_data: DataArg | None, out: Path, cfg: ZOConfig, name: str,
         resume: Any, log: Any, plot: Any, progress: bool, callback: Any) -> TrainResult:
    train = load_examples(engine, data, what="data")
    evals = load_examples(engine, eval_data, what="eval data") if eval_data is not None else []
    data_sha, eval_sha = digest(train), digest(evals)
    tr = ZOTrainer(engine, train, evals, out, cfg, name)
    t_wall = time.perf_counter()
    if resume is not None:
        tr.restore(Path(resume), data_sha, eval_sha)
    else:
        tr.start(init_factors(target_shapes(engine.model, cfg.targets), cfg.rank, cfg.seed))
        e0 = tr.evaluate()
        if e0 is not None:
            tr.rows.append(_eval_row(0, e0))
    wall0 = tr.timing["wall"]
    bar = progress_bar(cfg.steps, "zo", progress and cfg.steps > tr.step, unit="step", initial=tr.step, leave=True)
    try:
        while tr.step < cfg.steps:
            row = tr.do_step()
            if (cfg.eval_every and tr.step % cfg.eval_every == 0) or tr.step == cfg.steps:
                row["eval_loss"] = tr.evaluate()
            tr.timing["wall"] = wall0 + time.perf_counter() - t_wall
            row["elapsed_s"] = tr.timing["wall"]
            tr.rows.append(row)
            _bar_update(bar, row, tr.best_loss)
            if cfg.checkpoint_every and (tr.step % cfg.checkpoint_every == 0 or tr.step == cfg.steps):
                tr.checkpoint(data_sha, eval_sha)
            if log is not None and row["eval_loss"] is not None:
                write_log(log, tr.rows)  # so a long run can be watched (and survives a kill)
            if row["eval_loss"] is not None and not math.isfinite(row["eval_loss"]):
                tr.adapter.set_factors_multi(tr.best or tr.master)
                raise TrainingError(f"step {tr.step}: non-finite held-out loss", step=tr.step,
                                    hint="lower --lr or --eps")
            if callback is not None and callback(row) is False:
                break
    except TrainingError as e:
        _finish(tr, log, plot, failed=True)
        e.result = _result(tr)
        raise
    except KeyboardInterrupt:
        # Ctrl-C may land between θ±εz writes: put the last finished step back and keep what was learned.
        if tr.adapter is not None and tr.master:
            tr.adapter.set_factors_multi(tr.master)
            _finish(tr, log, plot, failed=True)
        raise
    finally:
        bar.close()
    tr.timing["wall"] = wall0 + time.perf_counter() - t_wall
    _finish(tr, log, plot, failed=False)
    return _result(tr)


def _eval_row(step: int, loss: float) -> dict[str, Any]:
    return {**dict.fromkeys(LOG_FIELDS), "step": step, "eval_loss": loss, "elapsed_s": 0.0}


def _finish(tr: ZOTrainer, log: Any, plot: Any, *, failed: bool) -> None:
    """Write OUT (and OUT.last), the log and the plot; after a good run the live adapter holds OUT."""
    if tr.evals and tr.best is not None:
        tr._save(tr.out, tr.best)
        tr._save(_last_path(tr.out), tr.master)
    else:
        tr._save(tr.out, tr.master)
    if log is not None:
        tr.log_file = write_log(log, tr.rows)
    if plot is not None:
        tr.plot_file = plot_losses(plot, tr.rows)
        if tr.plot_file is None:
            _log.warning("matplotlib is not installed: no loss curve written to %s (pip install matplotlib)", plot)
    if not failed and tr.best is not None and tr.evals:
        # The engine keeps the result under its name: OUT's factors, written in place (no reload).
        tr.adapter.set_factors_multi(tr.best)
    if not failed:
        tr.adapter.path, tr.adapter.source = tr.out, str(tr.out)


def _last_path(out: Path) -> Path:
    return out.with_name(out.name.removesuffix(".gguf") + ".last.gguf")


def _result(tr: ZOTrainer) -> TrainResult:
    steps = [r for r in tr.rows if r.get("loss") is not None]
    return TrainResult(
        out=tr.out, last=_last_path(tr.out) if tr.evals and tr.best is not None else None, name=tr.name,
        steps=tr.step, n_params=tr.n_params, losses=[r["loss"] for r in steps],
        eval_history=list(tr.eval_history), best_step=tr.best_step, best_eval_loss=tr.best_loss, log=tr.rows,
        write_seconds=tr.timing["write"], forward_seconds=tr.timing["forward"],
        other_seconds=tr.timing["other"], eval_seconds=tr.timing["eval"], wall_seconds=tr.timing["wall"],
        checkpoints=list(tr.checkpoints), log_file=tr.log_file, plot_file=tr.plot_file)


def _bar_update(bar: Bar, row: dict[str, Any], best: float | None) -> None:
    post = {"loss": f"{row['loss']:.4f}"}
    if row["eval_loss"] is not None:
        post["eval"] = f"{row['eval_loss']:.4f}"
    if best is not None:
        post["best"] = f"{best:.4f}"
    bar.set_postfix(post, refresh=False)
    bar.update(1)


LOG_FIELDS = ("step", "loss_plus", "loss_minus", "loss", "grad", "lr", "eval_loss", "write_s", "forward_s",
              "other_s", "step_s", "elapsed_s")


def write_log(path: str | os.PathLike[str], rows: Sequence[dict[str, Any]]) -> Path:
    """Write the per-step log as CSV (``.csv``) or JSON (anything else, a list of rows)."""
    p = Path(path)
    with atomic_path(p) as tmp:
        if p.suffix.lower() == ".csv":
            lines = [",".join(LOG_FIELDS)]
            for r in rows:
                lines.append(",".join("" if r.get(k) is None else repr(r[k]) for k in LOG_FIELDS))
            tmp.write_text("\n".join(lines) + "\n")
        else:
            tmp.write_text(json.dumps([{k: r.get(k) for k in LOG_FIELDS} for r in rows], indent=1))
    return p


def plot_losses(path: str | os.PathLike[str], rows: Sequence[dict[str, Any]]) -> Path | None:
    """PNG loss curve (train loss, its moving average, held-out loss); None if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    train = [(r["step"], r["loss"]) for r in rows if r.get("loss") is not None]
    evals = [(r["step"], r["eval_loss"]) for r in rows if r.get("eval_loss") is not None]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    if train:
        s, v = zip(*train)
        ax.plot(s, v, color="#9bb7d4", lw=0.8, label="train batch loss")
        k = max(1, len(v) // 20)
        avg = np.convolve(v, np.ones(k) / k, mode="valid")
        ax.plot(s[k - 1:], avg, color="#1f4e79", lw=1.6, label=f"train, moving average ({k})")
    if evals:
        s, v = zip(*evals)
        ax.plot(s, v, "o-", color="#c0392b", lw=1.4, ms=4, label="held-out loss")
    ax.set_xlabel("step")
    ax.set_ylabel("mean token NLL")
    ax.set_title("loramux zeroth-order LoRA training")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    p = Path(path)
    with atomic_path(p) as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)
    return p


__all__ = ["CHECKPOINT_FORMAT", "DEFAULT_TARGETS", "LOG_FIELDS", "RMS_BETA", "Factors", "TrainResult", "ZOConfig",
           "ZOTrainer", "init_factors", "plot_losses", "read_checkpoint", "target_shapes", "train_zo", "write_log"]
