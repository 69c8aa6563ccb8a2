"""Fine-tuning jobs on the serving engine (admin plane), in the shape of OpenAI's fine-tuning API:

    POST /v1/fine_tuning/jobs                 {training_file, model, suffix?, validation_file?, seed?,
                                               hyperparameters?}                    → the job
    GET  /v1/fine_tuning/jobs                 GET /v1/fine_tuning/jobs/{id}
    POST /v1/fine_tuning/jobs/{id}/cancel     GET /v1/fine_tuning/jobs/{id}/events (a loss per step)
    GET  /v1/fine_tuning/jobs/{id}/checkpoints

A job runs `train zo` (loramux.train) in a thread of its own on the live engine, beside traffic.
`model` is the base model (a new adapter, named by `suffix` or after the job) or a loaded adapter
(training continues from its factors, and the result is pushed into it as a new version). The job
trains a private adapter that no request can name, so requests never see its perturbed factors; what
it publishes is its master copy: at the end, and every `publish_every` steps if asked (a load the
first time, a factor push after that: engine/versions.py). Checkpoints are adapter GGUFs written
atomically (a temporary name, then a rename), every `checkpoint_every` steps and at the end.
A failed or cancelled job drops its private adapter and changes nothing else.

Training shares the engine thread with serving through train/paced.py (docs/train.md, "Training beside
serving"). Its forwards run on a context of the job's own, one small piece per engine command: a piece
costs at most `chunk` units (default 3: an unscored token is one unit, a scored one also pays the output
projection, 1.7 units more on Gemma 3 270M), so a piece is about an eighth of a serving step of 8 streams;
pieces take at most `share` (default 0.25) of the engine's time while requests are served, and at most one
runs between two serving steps (with 8 streams that binds first: about 10 % of the engine's time, 8–12 %
measured).
The job's thread runs at nice 19 (its own thread id), and the log-softmax of the scored rows runs there,
not on the engine thread. The job reports its steps per
minute and `engine_share`, the fraction of its wall time the engine spent on its forwards. Bounds:
MAX_ACTIVE jobs at a time, MAX_STEPS steps, MAX_RANK, the file store's bytes (files.py), MAX_KEPT jobs
remembered.
"""

from __future__ import annotations

import asyncio
import logging
import math
import secrets
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field

from ..errors import LoramuxError, TrainingError
from ..gguf_io import write_adapter
from ..train.data import Example, load_examples
from ..train.paced import DEFAULT_CHUNK, DEFAULT_SHARE, PacedEngine, lower_priority
from ..train.zo import ZOConfig, ZOTrainer, init_factors, target_shapes
from . import files
from .config import NAME_RE, NAME_RULE
from .errors import APIError, from_exception
from .files import FileStore
from .state import ServerState

log = logging.getLogger("loramux.server")
MAX_ACTIVE = 1
MAX_STEPS = 10_000
MAX_RANK = 64
MAX_KEPT = 64
FINAL = ("succeeded", "failed", "cancelled")


class Hyperparameters(BaseModel):
    """OpenAI's hyperparameters, and the zeroth-order run's own (loramux's names)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    n_epochs: int | Literal["auto"] = Field("auto", description="passes over the data (auto: 1)")
    batch_size: int | Literal["auto"] = "auto"
    learning_rate_multiplier: float | Literal["auto"] = "auto"
    steps: int | None = Field(None, ge=1, le=MAX_STEPS)
    rank: int | None = Field(None, ge=1, le=MAX_RANK)
    targets: list[str] | None = Field(None, min_length=1, max_length=16)
    lr: float | None = Field(None, gt=0)
    eps: float | None = Field(None, gt=0)
    publish_every: int = Field(0, ge=0)
    checkpoint_every: int = Field(0, ge=0)
    share: float = Field(DEFAULT_SHARE, gt=0, le=1)
    chunk: int = Field(DEFAULT_CHUNK, ge=1, le=512,
                       description="cost units per engine command (a token is 1, a scored token 1 + the head's)")


class JobRequest(BaseModel):
    """POST /v1/fine_tuning/jobs."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    model: str = Field(min_length=1, max_length=128)
    training_file: str = Field(min_length=1, max_length=64)
    validation_file: str | None = Field(None, max_length=64)
    suffix: str | None = Field(None, min_length=1, max_length=64)
    seed: int | None = Field(None, ge=0, le=2**31 - 1)
    hyperparameters: Hyperparameters = Field(default_factory=Hyperparameters)


@dataclass
class Job:
    """One fine-tuning job: OpenAI's job object fields, and what its thread needs."""

    id: str
    model: str
    output: str  # the adapter name the result is served under
    training_file: str
    validation_file: str | None
    seed: int
    cfg: ZOConfig
    hyper: Hyperparameters
    created_at: int = field(default_factory=lambda: int(time.time()))
    status: str = "queued"
    finished_at: int | None = None
    fine_tuned_model: str | None = None
    error: dict[str, Any] | None = None
    trained_tokens: int = 0
    events: list[dict[str, Any]] = field(default_factory=list)
    checkpoints: list[dict[str, Any]] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # versions published (continuing an adapter, or every N)
    cancel: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None
    steps_per_min: float | None = None
    engine_share: float | None = None  # of its wall time, the engine thread's time in its forwards

    def body(self) -> dict[str, Any]:
        return {"object": "fine_tuning.job", "id": self.id, "model": self.model, "created_at": self.created_at,
                "finished_at": self.finished_at, "fine_tuned_model": self.fine_tuned_model, "status": self.status,
                "training_file": self.training_file, "validation_file": self.validation_file,
                "hyperparameters": {"n_epochs": self.hyper.n_epochs, "batch_size": self.cfg.batch,
                                    "learning_rate_multiplier": self.hyper.learning_rate_multiplier,
                                    "steps": self.cfg.steps, "rank": self.cfg.rank, "lr": self.cfg.lr,
                                    "eps": self.cfg.eps, "share": self.hyper.share, "chunk": self.hyper.chunk},
                "result_files": [], "trained_tokens": self.trained_tokens, "error": self.error, "seed": self.seed,
                "organization_id": "loramux", "integrations": [], "estimated_finish": None, "metadata": None,
                "adapter_versions": list(self.versions), "steps_per_minute": self.steps_per_min,
                "engine_share": self.engine_share}

    def event(self, message: str, data: dict[str, Any] | None = None, level: str = "info") -> None:
        self.events.append({"object": "fine_tuning.job.event", "id": f"ftevent-{self.id[6:]}-{len(self.events)}",
                            "created_at": int(time.time()), "level": level, "message": message,
                            "data": data or {}, "type": "metrics" if data else "message"})


class JobManager:
    """The jobs of one server and the thread each runs in."""

    def __init__(self, state: ServerState, files: FileStore, root: Path) -> None:
        self.state, self.files, self.root = state, files, root
        self.jobs: dict[str, Job] = {}
        self.loop: asyncio.AbstractEventLoop | None = None

    def get(self, job_id: str) -> Job:
        if job_id not in self.jobs:
            raise APIError(404, f"no fine-tuning job {job_id!r}; GET /v1/fine_tuning/jobs lists them",
                           code="job_not_found", param="fine_tuning_job_id")
        return self.jobs[job_id]

    async def create(self, body: JobRequest) -> Job:
        """Check everything a job needs (data, model, name, bounds) and start it; 4xx naming the field."""
        active = [j for j in self.jobs.values() if j.status not in FINAL]
        if len(active) >= MAX_ACTIVE:
            raise APIError(429, f"{len(active)} fine-tuning job(s) running; at most {MAX_ACTIVE} at a time "
                                f"(cancel {active[0].id} or wait for it)", code="too_many_jobs")
        pool, eng = self.state.pool, self.state.engine
        base = body.model == self.state.base_name
        if not base and body.model not in pool.entries:
            raise APIError(404, f"model {body.model!r} is neither the base model ({self.state.base_name!r}) nor a "
                                "loaded adapter", code="model_not_found", param="model")
        output = body.model if not base else (body.suffix or "ft-" + secrets.token_hex(4))
        if base and (not NAME_RE.match(output) or output in pool.entries or output == self.state.base_name):
            raise APIError(400, f"suffix {output!r}: the new adapter's name must be {NAME_RULE} and not taken",
                           code="invalid_suffix", param="suffix")
        train = await self._examples(body.training_file, "training_file")
        evals = await self._examples(body.validation_file, "validation_file") if body.validation_file else []
        cfg = self._config(body, train, None if base else eng.adapter(body.model))
        job = Job("ftjob-" + secrets.token_hex(12), body.model, output, body.training_file, body.validation_file,
                  cfg.seed, cfg, body.hyperparameters)
        self.loop = asyncio.get_running_loop()
        self.jobs[job.id] = job
        self._forget_old()
        job.event(f"job created: {cfg.steps} steps, rank {cfg.rank}, {len(train)} examples")
        job.thread = threading.Thread(target=self._run, args=(job, train, evals), name=f"loramux-{job.id}",
                                      daemon=True)
        job.thread.start()
        return job

    async def _examples(self, file_id: str, param: str) -> list[Example]:
        path = self.files.path(file_id, param)
        try:
            return await asyncio.to_thread(load_examples, self.state.engine, path, what=param)
        except LoramuxError as e:
            raise APIError(400, str(e), code=e.code, param=param) from None

    def _config(self, body: JobRequest, train: list[Example], adapter: Any) -> ZOConfig:
        h = body.hyperparameters
        batch = min(len(train), 2 if h.batch_size == "auto" else int(h.batch_size))
        epochs = 1 if h.n_epochs == "auto" else int(h.n_epochs)
        steps = h.steps or max(1, math.ceil(epochs * len(train) / max(batch, 1)))
        if steps > MAX_STEPS or batch < 1 or epochs < 1:
            raise APIError(400, f"hyperparameters: {steps} steps of batch {batch} ({epochs} epochs); steps must be "
                                f"1..{MAX_STEPS}, batch and epochs ≥ 1", code="invalid_hyperparameters",
                           param="hyperparameters")
        mult = 1.0 if h.learning_rate_multiplier == "auto" else float(h.learning_rate_multiplier)
        lr = h.lr or ZOConfig.lr * mult
        kw: dict[str, Any] = {"steps": steps, "batch": batch, "lr": lr, "seed": body.seed or 0, "eval_every": 0,
                              "eps": h.eps or ZOConfig.eps}
        if adapter is not None:  # continuing: its rank, alpha and targets
            if h.rank is not None or h.targets is not None:
                raise APIError(400, f"hyperparameters: rank and targets are {body.model!r}'s own when continuing it",
                               code="invalid_hyperparameters", param="hyperparameters.rank")
            kw.update(rank=adapter.max_rank, alpha=adapter.alpha)
        else:
            kw.update(rank=h.rank or 8, targets=tuple(h.targets) if h.targets else ZOConfig.targets)
        try:
            cfg = ZOConfig(**kw).validate()
            if adapter is None:
                target_shapes(self.state.engine.model, cfg.targets)
        except LoramuxError as e:
            raise APIError(400, str(e), code="invalid_hyperparameters", param="hyperparameters") from None
        return cfg

    def _forget_old(self) -> None:
        done = [j for j in self.jobs.values() if j.status in FINAL]
        for j in done[: max(0, len(self.jobs) - MAX_KEPT)]:
            del self.jobs[j.id]

    # -- the job's thread ------------------------------------------------------------------------
    def _run(self, job: Job, train: list[Example], evals: list[Example]) -> None:
        eng = self.state.engine
        private = f"{job.id}-work"  # not in the server's table: no request can name it
        paced = PacedEngine(eng, job.cancel, job.hyper.share, job.hyper.chunk)
        lower_priority()  # this thread's numpy work yields the cores to the decoding threads
        t0 = time.monotonic()
        try:
            job.status = "running"
            tr = ZOTrainer(paced, train, evals, self.root / job.id / "out.gguf", job.cfg, private)  # type: ignore[arg-type]
            tr.start(self._initial(job))
            per_step = 2 * job.cfg.batch * sum(e.n_scored for e in train) / max(len(train), 1)
            loss = None
            while tr.step < job.cfg.steps:
                paced.check()
                loss = tr.do_step()["loss"]
                job.trained_tokens += round(per_step)
                wall = max(time.monotonic() - t0, 1e-9)
                job.steps_per_min, job.engine_share = tr.step / wall * 60, paced.forward_s / wall
                job.event(f"Step {tr.step}/{job.cfg.steps}: training loss={loss:.4f}",
                          {"step": tr.step, "train_loss": loss, "total_steps": job.cfg.steps})
                if tr.step < job.cfg.steps:
                    self._between_steps(job, tr, loss)
            valid = tr.evaluate() if evals else None
            if valid is not None:
                job.event(f"validation loss={valid:.4f}", {"step": tr.step, "valid_loss": valid})
            self._publish(job, tr, self._checkpoint(job, tr, loss))
            job.fine_tuned_model = job.output
            job.status = "succeeded"
            job.event(f"job succeeded: {job.output!r} serves the result")
        except BaseException as e:  # noqa: BLE001 - the job ends; serving and other adapters go on
            self._failed(job, e)
        finally:
            job.finished_at = int(time.time())
            try:
                paced.close()  # its context first: it holds the private adapter
                if private in eng.adapters:
                    eng.remove_lora(private)
            except LoramuxError:  # the engine is closing: it frees the adapter itself
                pass

    def _between_steps(self, job: Job, tr: ZOTrainer, loss: float) -> None:
        h = job.hyper
        publish = bool(h.publish_every and tr.step % h.publish_every == 0)
        if publish or (h.checkpoint_every and tr.step % h.checkpoint_every == 0):
            path = self._checkpoint(job, tr, loss)
            if publish:
                self._publish(job, tr, path)

    def _initial(self, job: Job) -> dict[str, Any]:
        eng = self.state.engine
        if job.model == self.state.base_name:
            return init_factors(target_shapes(eng.model, job.cfg.targets), job.cfg.rank, job.cfg.seed)
        return eng.adapter(job.output).all_factors()  # continuing a loaded adapter

    def _failed(self, job: Job, e: BaseException) -> None:
        if job.cancel.is_set():
            job.status = "cancelled"
            job.event("job cancelled; the adapters served are unchanged")
            return
        err = from_exception(e) if isinstance(e, Exception) else APIError(500, type(e).__name__)
        log.warning("fine-tuning job %s failed: %s", job.id, e)
        job.status = "failed"
        job.error = {"code": err.code or "training_error", "message": err.message, "param": None}
        job.event(f"job failed: {err.message}", level="error")

    def _checkpoint(self, job: Job, tr: ZOTrainer, loss: float | None) -> Path:
        """The master factors as an adapter GGUF (atomic: a temporary name, then a rename)."""
        path = self.root / job.id / f"step-{tr.step}.gguf"
        try:
            write_adapter(path, self.state.engine.model.architecture, tr.master, job.cfg.alpha, dtype="f32",
                          name=job.output)
        except OSError as e:
            raise TrainingError(f"step {tr.step}: the checkpoint {path.name} could not be written ({e}); "
                                "nothing was published from it", step=tr.step,
                                hint="check the jobs directory's disk (--jobs-dir)") from e
        job.checkpoints.append({"object": "fine_tuning.job.checkpoint", "id": f"ftckpt-{job.id[6:]}-{tr.step}",
                                "created_at": int(time.time()), "fine_tuned_model_checkpoint": str(path),
                                "step_number": tr.step, "metrics": {"train_loss": loss},
                                "fine_tuning_job_id": job.id})
        return path

    def _publish(self, job: Job, tr: ZOTrainer, path: Path) -> None:
        """Serve the master factors under the job's output name: a load the first time, then a push."""
        pool, loop = self.state.pool, self.loop
        assert loop is not None
        if job.output in pool.entries:
            version = self.state.engine.push_factors(job.output, tr.master)
            loop.call_soon_threadsafe(setattr, pool.entries[job.output], "pinned", True)
        else:
            fut = asyncio.run_coroutine_threadsafe(
                pool.load(job.output, str(path), pinned=True, written_here=True), loop)
            fut.result()
            version = self.state.engine.adapter(job.output).version
        job.versions.append(version)
        job.event(f"published {job.output!r} version {version} (step {tr.step})",
                  {"step": tr.step, "version": version})


def install(app: FastAPI, state: ServerState) -> JobManager:
    """The files and fine-tuning routes, over a jobs directory (settings.jobs_dir, else a temporary one)."""
    jobs_dir = state.settings.jobs_dir
    root = Path(jobs_dir) if jobs_dir else Path(tempfile.mkdtemp(prefix="loramux-jobs-"))
    store = FileStore(root / "files")
    files.add_routes(app, store)
    manager = JobManager(state, store, root)
    add_routes(app, manager)
    return manager


def add_routes(app: FastAPI, jobs: JobManager) -> None:
    """The /v1/fine_tuning routes over `jobs`."""

    @app.post("/v1/fine_tuning/jobs")
    async def create(body: JobRequest) -> dict[str, Any]:
        return (await jobs.create(body)).body()

    @app.get("/v1/fine_tuning/jobs")
    async def list_jobs(limit: int = 20, after: str | None = None) -> dict[str, Any]:
        items = sorted(jobs.jobs.values(), key=lambda j: j.created_at, reverse=True)
        if after is not None:
            ids = [j.id for j in items]
            items = items[ids.index(after) + 1:] if after in ids else []
        page = items[: max(1, min(limit, 100))]
        return {"object": "list", "data": [j.body() for j in page], "has_more": len(items) > len(page)}

    @app.get("/v1/fine_tuning/jobs/{job_id}")
    async def retrieve(job_id: str) -> dict[str, Any]:
        return jobs.get(job_id).body()

    @app.post("/v1/fine_tuning/jobs/{job_id}/cancel")
    async def cancel(job_id: str) -> dict[str, Any]:
        job = jobs.get(job_id)
        if job.status in FINAL:
            raise APIError(409, f"job {job_id} already {job.status}", code="job_finished",
                           param="fine_tuning_job_id")
        job.cancel.set()
        if job.thread is not None:
            await asyncio.to_thread(job.thread.join, 60.0)  # it stops within one forward
        return job.body()

    @app.get("/v1/fine_tuning/jobs/{job_id}/events")
    async def events(job_id: str, limit: int = 20, after: str | None = None) -> dict[str, Any]:
        return _page(list(reversed(jobs.get(job_id).events)), limit, after)

    @app.get("/v1/fine_tuning/jobs/{job_id}/checkpoints")
    async def checkpoints(job_id: str, limit: int = 10, after: str | None = None) -> dict[str, Any]:
        return _page(list(reversed(jobs.get(job_id).checkpoints)), limit, after)


def _page(items: list[dict[str, Any]], limit: int, after: str | None) -> dict[str, Any]:
    """OpenAI's cursor page: newest first, `after` an id, at most `limit` (≤ 10000) items."""
    if after is not None:
        ids = [x["id"] for x in items]
        items = items[ids.index(after) + 1:] if after in ids else []
    page = items[: max(1, min(limit, 10_000))]
    return {"object": "list", "data": page, "has_more": len(items) > len(page)}


__all__ = ["MAX_ACTIVE", "MAX_KEPT", "MAX_RANK", "MAX_STEPS", "Hyperparameters", "Job", "JobManager", "JobRequest",
           "add_routes", "install"]
