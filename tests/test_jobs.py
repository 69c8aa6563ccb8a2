"""Fine-tuning jobs on the serving engine: OpenAI's files and jobs API through the official client, training
beside live streams, continuing a loaded adapter (a new version), cancel, a checkpoint write that dies, bad jobs."""

from __future__ import annotations

import json
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import gguf
import httpx
import numpy as np
import openai
import pytest
from tinymodel import write_tiny_lora

import loramux as lm
from loramux.client import Client
from loramux.gguf_io import read_adapter_factors
from loramux.server import ServerSettings, create_app, serve_in_thread
from loramux.server.config import LoraEntry

ADMIN_KEY = "admin-key"
PROMPT = "the cat sat on the mat"
DATA = b"".join(json.dumps({"prompt": f"the {w} sat on", "completion": " the mat"}).encode() + b"\n"
                for w in ("cat", "dog", "cow", "fox", "owl", "bee", "ant", "elk", "emu", "yak", "rat", "bat"))


@contextmanager
def serving(model: Path, adir: Path, jobs_dir: Path, names: tuple[str, ...]):
    eng = lm.Engine.load(model, n_ctx=256, n_parallel=2, n_threads=1)
    entries = tuple(LoraEntry(n, str(adir / f"{n}.gguf")) for n in names)
    for e in entries:
        eng.load_lora(e.source, e.name)
    app = create_app(eng, ServerSettings(loras=entries, admin_api_key=ADMIN_KEY, api_key="user-key",
                                         jobs_dir=str(jobs_dir), max_upload_bytes=64 << 10), own_engine=True)
    with serve_in_thread(app) as srv:
        yield srv, eng, app.state.lm


@pytest.fixture(scope="module")
def server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory):
    d = tmp_path_factory.mktemp("jobs")
    for i, n in enumerate(("other", "cont"), 1):
        write_tiny_lora(d / f"{n}.gguf", seed=60 + i, rank=2, scale=0.4)
    with serving(tiny_model, d, d / "jobs", ("other", "cont")) as s:
        yield s


def admin(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=ADMIN_KEY, max_retries=0, timeout=120)


def greedy(srv, model: str, n: int = 16) -> list[int]:
    oa = openai.OpenAI(base_url=srv.url + "/v1", api_key="user-key", max_retries=0, timeout=120)
    r = oa.completions.create(model=model, prompt=PROMPT, max_tokens=n, temperature=0,
                              extra_body={"return_token_ids": True, "ignore_eos": True})
    return r.choices[0].model_extra["token_ids"]


def wait(oa: openai.OpenAI, job_id: str, timeout: float = 300) -> object:
    deadline = time.monotonic() + timeout
    while (job := oa.fine_tuning.jobs.retrieve(job_id)).status not in ("succeeded", "failed", "cancelled"):
        assert time.monotonic() < deadline, job
        time.sleep(0.05)
    return job


def private_adapters(eng) -> list[str]:
    return [n for n in eng.adapters if n.startswith("ftjob-")]


def test_job_trains_beside_streams_and_serves_by_name(server):
    srv, eng, _ = server
    oa = admin(srv)
    other_before = greedy(srv, "other")
    f = oa.files.create(file=("data.jsonl", DATA), purpose="fine-tune")
    assert f.bytes == len(DATA) and f.purpose == "fine-tune"
    served, errors, stop = [], [], threading.Event()

    def stream_loop() -> None:  # live traffic on another adapter for the whole job
        user = openai.OpenAI(base_url=srv.url + "/v1", api_key="user-key", max_retries=0, timeout=120)
        while not stop.is_set():
            try:
                text = "".join(c.choices[0].text for c in user.completions.create(
                    model="other", prompt=PROMPT, max_tokens=24, temperature=0, stream=True))
                served.append(text)
            except Exception as e:  # noqa: BLE001 - collected and asserted below
                errors.append(e)
    threads = [threading.Thread(target=stream_loop) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        job = oa.fine_tuning.jobs.create(model="tiny", training_file=f.id, suffix="learned",
                                         hyperparameters={"n_epochs": 1, "batch_size": 2})
        assert job.status in ("queued", "running")
        job = wait(oa, job.id)
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert job.status == "succeeded", job.error
    assert job.fine_tuned_model == "learned"
    assert not errors and served
    events = [e for e in oa.fine_tuning.jobs.list_events(job.id, limit=100) if e.data and "train_loss" in e.data]
    assert sorted(e.data["step"] for e in events) == list(range(1, 7))  # 12 examples / batch 2
    assert all(np.isfinite(e.data["train_loss"]) for e in events)
    # the result serves by name, exactly as a fresh load of its final checkpoint
    ckpt = oa.fine_tuning.jobs.checkpoints.list(job.id).data[0]
    assert ckpt.step_number == 6
    with lm.Engine.load(eng.model.path, n_ctx=256, n_parallel=2, n_threads=1,
                        loras=[ckpt.fine_tuned_model_checkpoint]) as fresh:
        want = fresh.generate(PROMPT, loras={Path(ckpt.fine_tuned_model_checkpoint).stem: 1.0}, max_tokens=16,
                              temperature=0, ignore_eos=True).tokens
    assert greedy(srv, "learned") == want
    assert greedy(srv, "other") == other_before  # the other adapter is untouched
    assert private_adapters(eng) == []


def test_continuing_a_loaded_adapter_pushes_a_new_version(server):
    srv, eng, _ = server
    v0 = eng.adapter("cont").version
    with Client(srv.url, api_key=ADMIN_KEY) as c:
        fid = c.upload_file(DATA)["id"]
        job = c.wait(c.create_job(fid, model="cont", hyperparameters={"steps": 3, "publish_every": 1})["id"])
        assert job["status"] == "succeeded", job["error"]
        assert job["adapter_versions"] == [v0 + 1, v0 + 2, v0 + 3]
        assert job["steps_per_minute"] > 0 and 0 < job["engine_share"] <= 1, job
        assert c.adapter("cont")["version"] == v0 + 3
        ckpts = c.http.get(f"/v1/fine_tuning/jobs/{job['id']}/checkpoints").json()["data"]
    last = max(ckpts, key=lambda x: x["step_number"])
    assert last["step_number"] == 3
    live = eng.adapter("cont").all_factors()
    saved = read_adapter_factors(last["fine_tuned_model_checkpoint"])
    assert live.keys() == saved.keys()
    assert all(np.array_equal(live[k][0], saved[k][0]) and np.array_equal(live[k][1], saved[k][1]) for k in live)


def test_cancel_stops_a_job_and_changes_nothing(server):
    srv, eng, st = server
    before = greedy(srv, "other")
    oa = admin(srv)
    fid = oa.files.create(file=("d.jsonl", DATA), purpose="fine-tune").id
    with Client(srv.url, api_key=ADMIN_KEY) as c:
        job = c.create_job(fid, model="tiny", suffix="never", hyperparameters={"steps": 5000})
        deadline = time.monotonic() + 120
        while not any("train_loss" in e["data"] for e in c.events(job["id"])):
            assert time.monotonic() < deadline
            time.sleep(0.02)
    job = oa.fine_tuning.jobs.cancel(job["id"])
    assert job.status == "cancelled" and job.fine_tuned_model is None
    assert "never" not in st.pool.entries and private_adapters(eng) == []
    assert greedy(srv, "other") == before


def test_a_checkpoint_write_that_dies_midway_leaves_serving_untouched(server, monkeypatch):
    srv, eng, st = server
    before, v_other = greedy(srv, "other"), eng.adapter("other").version
    real = gguf.GGUFWriter.write_tensors_to_file
    calls = []

    def dies_in_the_second_checkpoint(self, *a, **k):
        # writes: 1 the job's working adapter, 2 the step-1 checkpoint, 3 the step-2 one, which dies
        # after its bytes are out but before the write finished (the rename into place never happens)
        calls.append(1)
        real(self, *a, **k)
        if len(calls) == 3:
            raise OSError("killed mid-write")
    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", dies_in_the_second_checkpoint)
    with Client(srv.url, api_key=ADMIN_KEY) as c:
        fid = c.upload_file(DATA)["id"]
        job = c.wait(c.create_job(fid, model="tiny", suffix="dies", hyperparameters={"steps": 4,
                                                                                    "checkpoint_every": 1})["id"])
        ckpts = c.http.get(f"/v1/fine_tuning/jobs/{job['id']}/checkpoints").json()["data"]
    assert job["status"] == "failed" and "killed mid-write" in job["error"]["message"]
    assert [x["step_number"] for x in ckpts] == [1]
    d = Path(ckpts[0]["fine_tuned_model_checkpoint"]).parent
    assert sorted(p.name for p in d.iterdir()) == ["step-1.gguf"]  # no half-written file, no temporary left
    assert len(read_adapter_factors(d / "step-1.gguf")) > 0  # the checkpoint before is whole
    assert "dies" not in st.pool.entries and private_adapters(eng) == []
    assert greedy(srv, "other") == before and eng.adapter("other").version == v_other


def test_bad_jobs_and_files_get_clear_errors(server):
    srv, eng, _ = server
    oa = admin(srv)
    h = {"Authorization": f"Bearer {ADMIN_KEY}"}
    bad_records = oa.files.create(file=("bad.jsonl", b'{"foo": 1}\n{"text": ""}\n'), purpose="fine-tune").id
    cases = [({"model": "tiny", "training_file": bad_records}, 400, "training_error", "training_file"),
             ({"model": "tiny", "training_file": "file-nope"}, 404, "file_not_found", "training_file"),
             ({"model": "nope", "training_file": bad_records}, 404, "model_not_found", "model"),
             ({"model": "tiny", "training_file": bad_records, "hyperparameters": {"steps": 0}}, 400,
              "invalid_request", "hyperparameters.steps"),
             ({"model": "tiny", "training_file": bad_records, "method": {}}, 400, "invalid_request", "method"),
             ({"model": "tiny", "training_file": bad_records, "suffix": "other"}, 400, "invalid_suffix", "suffix")]
    for body, status, code, param in cases:
        r = httpx.post(srv.url + "/v1/fine_tuning/jobs", json=body, headers=h)
        assert r.status_code == status, (body, r.text)
        assert (r.json()["error"]["code"], r.json()["error"]["param"]) == (code, param), r.text
    for data, purpose, status, code in [(b"not json\n", "fine-tune", 400, "invalid_file"),
                                        (b"[1]\n", "fine-tune", 400, "invalid_file"),
                                        (DATA, "assistants", 400, "invalid_purpose"),
                                        (b"x" * (80 << 10), "fine-tune", 413, "request_too_large")]:
        r = httpx.post(srv.url + "/v1/files", files={"file": ("f.jsonl", data)}, data={"purpose": purpose}, headers=h)
        assert r.status_code == status and r.json()["error"]["code"] == code, r.text
    for key in ("user-key", "wrong"):  # the admin plane only
        r = httpx.get(srv.url + "/v1/fine_tuning/jobs", headers={"Authorization": f"Bearer {key}"})
        assert r.status_code in (401, 403), r.text
    assert private_adapters(eng) == []


def test_paced_losses_are_the_engines(tiny_model, tiny_dir):
    """The job's chunked loss on its own context: one chunk per text is Engine.loss_sum bit for bit; small
    chunks spread the same forward over several engine commands."""
    from loramux.train.paced import PacedEngine

    with lm.Engine.load(tiny_model, n_ctx=256, n_threads=1, loras=[str(tiny_dir / "a.gguf")]) as eng:
        texts = [eng.tokenize(t) for t in ("the cat sat on the mat", "hello world and the dog ran far away")]
        masks = [[i % 2 == 0 for i in range(len(t))] for t in texts]
        want = eng.loss_sum(texts, loras={"a": 1.0}, masks=masks, control=None)
        whole = PacedEngine(eng, threading.Event(), share=1.0, chunk=eng.options.n_batch)
        small = PacedEngine(eng, threading.Event(), share=1.0, chunk=3)
        got = whole.loss_sum(texts, loras={"a": 1.0}, masks=masks)
        chunked = small.loss_sum(texts, loras={"a": 1.0}, masks=masks)
        whole.close()
        small.close()
    assert got == want
    assert chunked[1] == want[1] and abs(chunked[0] - want[0]) <= 1e-3 * abs(want[0])


def test_pieces_are_cost_bounded():
    """A piece holds at most `budget` cost units (a scored token costs 1 + head), at least one token, and the
    pieces cover the tokens in order."""
    from loramux.train.paced import pieces

    assert pieces(6, [False, False, True, True, False, False], 3, 1.7) == [(0, 2), (2, 3), (3, 4), (4, 6)]
    assert pieces(3, [True, True, True], 2, 1.7) == [(0, 1), (1, 2), (2, 3)]  # over budget alone: one token
    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(1, 40))
        want = [bool(x) for x in rng.random(n) < 0.3]
        budget, head = float(rng.integers(1, 8)), float(rng.random() * 3)
        got = pieces(n, want, budget, head)
        assert [a for a, _ in got] == [0] + [b for _, b in got[:-1]] and got[-1][1] == n
        for a, b in got:
            cost = sum(1.0 + (head if want[i] else 0.0) for i in range(a, b))
            assert b > a and (b - a == 1 or cost <= budget), (a, b, cost, budget)
