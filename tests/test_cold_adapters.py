"""Adapters registered cold from directories (`--lora-dir`, server/lora_dirs.py): nothing is loaded at start,
the first request naming one loads it through the engine's loaded tier, off the engine thread's decode
steps; a bad file fails its request alone; start-time problems are one typed error. Real uvicorn on
127.0.0.1 and real llama.cpp (the suite's tiny model)."""

from __future__ import annotations

import gc
import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import numpy as np
import pytest
from tinymodel import write_tiny_lora

import loramux as lm
from loramux import _native as N
from loramux.engine.adapters import LoRAAdapter
from loramux.errors import AdapterDirError, ParameterError
from loramux.gguf_io import write_adapter
from loramux.server import ServerSettings, create_app, serve_in_thread
from loramux.server.config import RANK_SAMPLE, dir_sample
from loramux.server.lora_dirs import scan

PROMPT = "the cat sat"
ADMIN = {"Authorization": "Bearer admin-key"}


@contextmanager
def serving(model: Path, dirs: list[Path], *, parallel: int = 1, loras: tuple[tuple[str, Path], ...] = (),
            **settings: object) -> Iterator[tuple[object, lm.Engine, object]]:
    """Engine + app + uvicorn thread with `dirs` as --lora-dir; `loras` loaded at start (pinned)."""
    eng = lm.Engine.load(model, n_ctx=256, n_parallel=parallel, n_threads=1, slots=0)
    try:
        for name, path in loras:
            eng.load_lora(path, name)
        cfg = ServerSettings(lora_dirs=tuple(map(str, dirs)), admin_api_key="admin-key", **settings)
        app = create_app(eng, cfg, own_engine=True)
    except BaseException:
        eng.close()
        raise
    with serve_in_thread(app) as srv:
        yield srv, eng, app.state.lm


def complete(srv: object, model: str, max_tokens: int = 6, **extra: object) -> httpx.Response:
    return httpx.post(srv.url + "/v1/completions", timeout=120,
                      json={"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
                            "return_token_ids": True, **extra})


@pytest.fixture(scope="module")
def cold_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("cold")
    for i in range(6):
        write_tiny_lora(d / f"c{i}.gguf", seed=200 + i, rank=4, scale=0.5)
    return d


@pytest.fixture()
def held_loads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every adapter llama.cpp is asked to hold (the real load runs; its path is recorded)."""
    seen: list[str] = []
    real = N.AdapterHandle.load.__func__

    def load(cls, model, path):  # noqa: ANN001, ANN202 - the classmethod's own signature
        seen.append(path)
        return real(cls, model, path)
    monkeypatch.setattr(N.AdapterHandle, "load", classmethod(load))
    return seen


def test_registering_loads_nothing_and_the_first_request_loads_one_exactly_as_lora_would(
        tiny_model, cold_dir, held_loads):
    with lm.Engine.load(tiny_model, n_ctx=256, n_threads=1, slots=0) as ref:
        ref.load_lora(cold_dir / "c3.gguf", "c3")
        want = ref.generate(PROMPT, loras={"c3": 1.0}, max_tokens=6).tokens
    held_loads.clear()
    with serving(tiny_model, [cold_dir], max_loaded=2) as (srv, eng, state):
        assert len(eng.adapters) == 0 and held_loads == [] and len(eng.loaded.cold) == 6
        assert sorted(state.pool.entries) == [f"c{i}" for i in range(6)]
        listed = httpx.get(srv.url + "/v1/models").json()["data"]
        assert [(m["id"], m["resident"]) for m in listed[1:]] == [(f"c{i}", False) for i in range(6)]
        r = complete(srv, "c3")
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == want
        assert sorted(eng.adapters) == ["c3"] and len(held_loads) == 1 and len(eng.loaded.cold) == 5
        rows = {x["name"]: x["resident"] for x in httpx.get(srv.url + "/lora-adapters").json()}
        assert rows == {f"c{i}": i == 3 for i in range(6)}
        r = complete(srv, "tiny", lora=[{"name": "c1"}])  # by the `lora` list too
        assert r.status_code == 200 and sorted(eng.adapters) == ["c1", "c3"]
        for name in ("c3", "c5"):  # unload a loaded and a never-loaded cold entry
            assert httpx.post(srv.url + "/v1/unload_lora_adapter", headers=ADMIN,
                              json={"lora_name": name}).status_code == 200
        assert "c5" not in eng.loaded.cold and complete(srv, "c5").status_code == 404
        assert len(held_loads) == 2


def test_a_cold_load_does_not_stop_other_sequences_decoding(tiny_model, cold_dir, monkeypatch):
    """While the cold adapter's llama.cpp load is held (after its parse, inside llama_adapter_lora_init's
    turn), a request on another adapter keeps taking decode steps: nothing of the load runs on the engine
    thread. Then the cold request completes."""
    entered, gate = threading.Event(), threading.Event()
    on_engine: list[str] = []
    real = N.AdapterHandle.load.__func__

    def load(cls, model, path):  # noqa: ANN001, ANN202 - the classmethod's own signature
        if threading.current_thread().name == "loramux-engine":
            on_engine.append(path)
        if os.path.realpath(path).endswith("c2.gguf"):
            entered.set()
            assert gate.wait(60)
        return real(cls, model, path)
    monkeypatch.setattr(N.AdapterHandle, "load", classmethod(load))
    with serving(tiny_model, [cold_dir], parallel=2, loras=(("p", cold_dir / "c0.gguf"),)) as (srv, eng, _):
        cold: list[httpx.Response] = []
        asker = threading.Thread(target=lambda: cold.append(complete(srv, "c2")))
        asker.start()
        assert entered.wait(60)  # the cold request is in llama.cpp's load, held
        steps = eng.stats().decode_steps
        long = complete(srv, "p", max_tokens=100, ignore_eos=True)  # runs start to end meanwhile
        during = eng.stats().decode_steps - steps
        held = not cold and "c2" not in eng.adapters
        gate.set()
        asker.join(120)
        assert long.status_code == 200 and len(long.json()["choices"][0]["token_ids"]) == 100
        assert held and during >= 100, f"only {during} decode steps while the cold adapter was loaded"
        assert cold[0].status_code == 200 and "c2" in eng.adapters
        assert on_engine == [] and eng.loaded.stats["loaded_off_thread"] == 1


def test_a_thousand_registered_keep_loaded_and_rss_bounded(tiny_model, tmp_path):
    one = write_tiny_lora(tmp_path / "one.gguf", seed=7, rank=4, scale=0.5)
    d = tmp_path / "many"
    d.mkdir()
    for i in range(1000):
        os.link(one, d / f"m{i:04d}.gguf")
    k = 120
    with serving(tiny_model, [d], max_loaded=4, metric_adapters=10) as (srv, eng, state):
        assert len(state.pool.entries) == 1000 and len(eng.adapters) == 0
        marks, peak = [], 0
        with httpx.Client(timeout=120) as c:
            for phase in range(3):
                for i in range(phase * k, (phase + 1) * k):
                    r = c.post(srv.url + "/v1/completions", json={"model": f"m{i:04d}", "prompt": PROMPT,
                                                                 "max_tokens": 2, "temperature": 0})
                    assert r.status_code == 200, r.text
                    peak = max(peak, len(eng.adapters))
                marks.append(_rss())
        assert peak <= 4 and eng.loaded.stats["peak"] <= 4 and eng.loaded.stats["reloads"] == 3 * k
        assert len(eng.loaded.lru.order()) <= 4 and len(eng.loaded.cold) + len(eng.adapters) == 1000
        gc.collect()
        # this server's adapters only: other tests in the same process may still hold their own
        live = [o for o in gc.get_objects() if isinstance(o, LoRAAdapter) and o.model is eng.model]
        # the 4 loaded, plus a few evicted ones a finished request's records may still name until freed
        assert len(live) <= 8, f"{len(live)} adapters held after {3 * k} cold loads"
        # RSS over the last K cold loads, against a margin from this run's own file: a quarter of what
        # keeping each adapter's file bytes would add, plus 1 MiB of allocator and page granularity
        margin = (1 << 20) + k * one.stat().st_size // 4
        assert marks[2] - marks[1] <= margin, f"RSS after {k}, {2 * k}, {3 * k} requests: {marks}, margin {margin}"
        text = httpx.get(srv.url + "/metrics").text
        labels = {ln.split('adapter="')[1].split('"')[0] for ln in text.splitlines()
                  if ln.startswith("loramux_adapter_requests_total{")}
        assert len(labels) == 11 and "_other_" in labels  # 10 named, the rest under one label


def test_a_bad_file_fails_its_request_alone(tiny_model, tmp_path, cold_dir):
    d = tmp_path / "mixed"
    d.mkdir()
    (d / "junk.gguf").write_bytes(b"not a gguf file at all")
    os.link(cold_dir / "c1.gguf", d / "good.gguf")
    rng = np.random.default_rng(1)  # in-features 7 where the base's attn_q has 64: the wrong base
    write_adapter(d / "shape.gguf", "llama", {"blk.0.attn_q.weight": (rng.standard_normal((4, 7)).astype(np.float32),
                                                                      rng.standard_normal((64, 4)).astype(np.float32))},
                  4.0)
    with serving(tiny_model, [d], parallel=2) as (srv, eng, _):
        for bad in ("junk", "shape"):
            r = complete(srv, bad)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert bad in err["message"] and f"{bad}.gguf" in err["message"] and err["param"] == "model"
            assert str(d) not in err["message"]  # the file's name, not its directories
            assert bad in eng.loaded.cold and bad not in eng.adapters
        r = complete(srv, "tiny", lora=[{"name": "junk"}])
        assert r.status_code == 400 and r.json()["error"]["param"] == "lora"
        assert complete(srv, "good").status_code == 200 and httpx.get(srv.url + "/health").status_code == 200


def test_the_default_slot_rank_follows_a_sample_of_the_directories(tiny_model, tmp_path):
    """Without --slot-rank, a server whose adapters come from --lora-dir sizes its bank slots by the widest
    rank among a bounded sample of the files (headers only), as it does for --lora adapters: a slot twice
    too wide costs every masked decode, one too narrow serves the adapter without the bank."""
    d = tmp_path / "dir"
    d.mkdir()
    for i in range(RANK_SAMPLE + 8):  # more files than the sample: the first is always in it
        write_tiny_lora(d / f"r{i:02d}.gguf", seed=300 + i, rank=4)
    picked = dir_sample([str(d)])
    assert len(picked) == RANK_SAMPLE and picked[0].name == "r00.gguf" and len(set(picked)) == RANK_SAMPLE
    assert ServerSettings(lora_dirs=(str(d),)).engine_options().slot_rank == 8
    assert ServerSettings().engine_options().slot_rank == 16  # nothing known: the fallback
    assert ServerSettings(lora_dirs=(str(d),), slot_rank=4).engine_options().slot_rank == 4
    write_tiny_lora(d / "r00.gguf", seed=300, rank=20)
    cfg = ServerSettings(lora_dirs=(str(d),), parallel=2, n_ctx=256, threads=1)
    eng = cfg.build_engine()
    try:
        assert eng.bank is not None and (eng.bank.K, eng.bank.r) == (2, 24)
    finally:
        eng.close()


def test_start_problems_are_one_typed_error_listing_all(tmp_path, cold_dir):
    a, b, out = tmp_path / "a", tmp_path / "b", tmp_path / "out"
    for x in (a, b, out):
        x.mkdir()
    write_tiny_lora(a / "x.gguf")
    write_tiny_lora(b / "x.gguf")  # the same name in two directories
    write_tiny_lora(a / "-bad.gguf")  # not an adapter name
    write_tiny_lora(a / "base.gguf")  # the served model's name
    write_tiny_lora(out / "far.gguf")
    (a / "far.gguf").symlink_to(out / "far.gguf")  # leaves the directory
    (a / "dir.gguf").mkdir()  # not a regular file
    write_tiny_lora(a / ".partial.gguf")  # skipped: a dot file
    (a / "notes.txt").write_text("skipped: not *.gguf")
    with pytest.raises(AdapterDirError) as e:
        scan([str(a), str(b)], taken=["base"])
    msg = str(e.value)
    assert e.value.code == "invalid_adapter_dir" and e.value.dirs == [str(a), str(b)]
    assert len(e.value.problems) == 5, e.value.problems
    for part in ("'x'", "'-bad'", "'base'", "far.gguf", "dir.gguf"):
        assert part in msg, part
    assert "partial" not in msg and "notes" not in msg
    ok = scan([str(cold_dir)], limit=6)
    assert [f.name for f in ok] == [f"c{i}" for i in range(6)]
    with pytest.raises(AdapterDirError, match="more than the 5"):
        scan([str(cold_dir)], limit=5)
    with pytest.raises(ParameterError, match="lora_dirs"):
        ServerSettings(lora_dirs=(str(tmp_path / "missing"),)).validated()


def test_the_server_refuses_loads_past_max_adapters(tiny_model, cold_dir):
    with serving(tiny_model, [cold_dir], max_adapters=6, adapter_dirs=(str(cold_dir),)) as (srv, _, _):
        r = httpx.post(srv.url + "/v1/load_lora_adapter", headers=ADMIN,
                       json={"lora_name": "seventh", "lora_path": "c0.gguf"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_adapters"


def _until(cond, timeout: float = 60.0, must: bool = True) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            assert not must, "timed out"
            return
        time.sleep(0.0005)  # short: a fast host decodes dozens of the tiny model's tokens in 5 ms


def _rss() -> int:
    gc.collect()
    if not sys.platform.startswith("linux"):
        pytest.skip("reads RSS from /proc")
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_loads_arriving_together_are_loaded_on_their_own_threads(tiny_model, cold_dir):
    """Three submits on three cold adapters queued at once while a sequence decodes: each is loaded on its
    submitting thread, so the engine registers all three in one step, none waiting for a turn."""
    from loramux.engine.residency import ColdAdapter

    with lm.Engine.load(tiny_model, n_ctx=1024, n_parallel=4, n_threads=1, slots=0) as eng:
        eng.load_lora(cold_dir / "c0.gguf", "p")
        names = ["c1", "c2", "c3"]
        eng.call(lambda: eng.loaded.register_cold(ColdAdapter(n, cold_dir / f"{n}.gguf", n) for n in names))
        threads: list[str] = []
        real = eng.loaded._build
        eng.loaded._build = lambda cold: (threads.append(threading.current_thread().name), real(cold))[1]
        # 900 tokens: `long` must still decode when the engine is held (a fast host decodes the tiny model's
        # tokens in ~0.1 ms; 120 could all go by within one poll of _until)
        long = eng.submit_async(PROMPT, loras={"p": 1.0}, max_tokens=900, ignore_eos=True).result()
        _until(lambda: eng.scheduler.stats.decode_steps >= 2)
        gate = threading.Event()
        eng.call_async(gate.wait)  # hold the engine while the three submits queue behind it
        try:
            futs = [eng.submit_async(PROMPT, loras={n: 1.0}, max_tokens=4) for n in names]  # loaded here, queued
        finally:
            gate.set()
        done = [lm.TextStream(f.result()).consume() for f in futs]
        lm.TextStream(long).consume()
        assert [len(c.tokens) for c in done] == [4, 4, 4]
        assert len(threads) == 3 and "loramux-engine" not in threads, threads
        assert eng.loaded.stats["loaded_off_thread"] == 3 and eng.loaded.stats["deferred"] == 0


def test_loads_left_to_the_engine_thread_take_one_decode_step_each(tiny_model, cold_dir):
    """Where nothing loaded a cold adapter beforehand (here: no submit-side load at all), the engine thread
    loads it, and three arriving together while a sequence decodes each get their own gap between steps
    (such a load costs tens of ms), never three back to back."""
    from loramux.engine.residency import ColdAdapter

    with lm.Engine.load(tiny_model, n_ctx=1024, n_parallel=4, n_threads=1, slots=0) as eng:
        eng.load_lora(cold_dir / "c0.gguf", "p")
        names = ["c1", "c2", "c3"]
        eng.call(lambda: eng.loaded.register_cold(ColdAdapter(n, cold_dir / f"{n}.gguf", n) for n in names))
        eng.loaded.prepare = lambda names: None  # every load is then the engine thread's
        at: list[int] = []
        real = eng.loaded._build
        eng.loaded._build = lambda cold: (at.append(eng.scheduler.stats.decode_steps), real(cold))[1]
        # 900 tokens: `long` must still decode when the engine is held (a fast host decodes the tiny model's
        # tokens in ~0.1 ms; 120 could all go by within one poll of _until)
        long = eng.submit_async(PROMPT, loras={"p": 1.0}, max_tokens=900, ignore_eos=True).result()
        _until(lambda: eng.scheduler.stats.decode_steps >= 2)
        gate = threading.Event()
        eng.call_async(gate.wait)  # hold the engine while the three submits queue behind it
        try:
            futs = [eng.submit_async(PROMPT, loras={n: 1.0}, max_tokens=4) for n in names]
        finally:
            gate.set()
        done = [lm.TextStream(f.result()).consume() for f in futs]
        lm.TextStream(long).consume()
        assert [len(c.tokens) for c in done] == [4, 4, 4]
        assert len(at) == 3 and at[0] < at[1] < at[2], f"decode steps at each load: {at}"
        assert eng.loaded.stats["deferred"] >= 2 and eng.loaded.stats["parsed_on_engine_thread"] == 3
