"""In-place factor writes: bit-identical to a fresh load, read-back, save, bad input, serialization."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import numpy as np
import pytest
from conftest import PROMPT, max_diff
from tinymodel import random_factors, write_tiny_lora

import loramux as lm
from loramux import _native as N
from loramux.engine import factor_stage
from loramux.engine.adapters import LoRAAdapter
from loramux.engine.model import Context, ContextOptions
from loramux.gguf_io import read_adapter_factors


@pytest.fixture(params=["mirror", "direct"])
def write_path(request, monkeypatch):
    """Small adapters are written through a staging mirror, large ones tensor by tensor: test both."""
    if request.param == "direct":
        monkeypatch.setattr(factor_stage, "MIRROR_MAX_BYTES", 0)
    return request.param


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_write_in_place_equals_fresh_load(tiny_model, tmp_path, dtype, write_path):
    src = tmp_path / "src"
    src.mkdir()
    write_tiny_lora(src / "x.gguf", seed=11, dtype=dtype)
    new = random_factors(rank=2, seed=12)
    eng = lm.Engine.load(tiny_model, n_ctx=256, n_threads=2, loras=[str(src / "x.gguf")])
    try:
        a = eng.adapter("x")
        before = eng.logits(PROMPT)
        v0 = a.version
        a.set_factors_multi(new)
        assert a.version == v0 + 1
        shutil.rmtree(src)  # no file left: a re-parse cannot be what passes this test
        written = eng.logits(PROMPT)
        assert max_diff(written, before) > 1e-3
        # a context created after the write sees the new factors too
        def new_ctx_logits() -> np.ndarray:
            ctx = Context(eng.model, ContextOptions(n_ctx=256, n_batch=64, n_threads=2))
            try:
                ctx.handle.set_adapters([a.handle], [1.0])
                return ctx.prefill(0, eng.tokenize(PROMPT), all_logits=True)
            finally:
                ctx.close()
        in_new_ctx = eng.call(new_ctx_logits)
    finally:
        eng.close()
    write_tiny_lora(tmp_path / "fresh.gguf", seed=12, dtype=dtype)  # same factors, fresh file
    with lm.Engine.load(tiny_model, n_ctx=256, n_threads=2, loras=[str(tmp_path / "fresh.gguf")]) as fresh:
        ref = fresh.logits(PROMPT)
    assert max_diff(written, ref) == 0.0
    assert max_diff(in_new_ctx, ref) == 0.0


def test_write_mid_sequence_keeps_kv(engine, tiny_dir, tmp_path):
    a = engine.load_lora(tiny_dir / "a.gguf", name="x")
    new = random_factors(rank=2, seed=21)
    write_tiny_lora(tmp_path / "new.gguf", seed=21)
    b = engine.load_lora(tmp_path / "new.gguf", name="y")
    toks = engine.tokenize(PROMPT)
    k = 5

    def run(write: bool) -> np.ndarray:
        ctx = Context(engine.model, ContextOptions(n_ctx=256, n_batch=64, n_threads=2))
        try:
            ctx.handle.set_adapters([a.handle], [1.0])
            ctx.prefill(0, toks[:k])
            if write:
                a.set_factors_multi(new)  # on the engine thread already: runs inline
            else:
                ctx.handle.set_adapters([b.handle], [1.0])
            return ctx.prefill(0, toks[k:], pos0=k, all_logits=True)
        finally:
            ctx.close()
    control = engine.call(lambda: run(False))
    got = engine.call(lambda: run(True))
    assert max_diff(got, control) == 0.0


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_get_factors_returns_what_was_written(engine, tmp_path, dtype, write_path):
    write_tiny_lora(tmp_path / "x.gguf", seed=3, dtype=dtype)
    a = engine.load_lora(tmp_path / "x.gguf")
    assert a.factor_names()[0] == "blk.0.attn_q.weight" and a.n_factors == 14
    new = random_factors(rank=2, seed=4)
    a.set_factors_multi(new)
    for name, (na, nb) in new.items():
        ga, gb = a.get_factors(name)
        if dtype == "f32":
            assert np.array_equal(ga, na) and np.array_equal(gb, nb)
        elif dtype == "f16":
            assert np.array_equal(ga, na.astype(np.float16).astype(np.float32))
        else:
            assert np.allclose(ga, na, rtol=1e-2, atol=1e-6)
    # float16 input is accepted and converted
    name = a.factor_names()[1]
    ha, hb = (x.astype(np.float16) for x in new[name])
    a.set_factors(name, ha, hb)
    assert np.allclose(a.get_factors(name)[0], ha.astype(np.float32), rtol=1e-2)


def test_save_then_reload_is_identical(engine, tiny_model, tmp_path):
    write_tiny_lora(tmp_path / "x.gguf", seed=5)
    a = engine.load_lora(tmp_path / "x.gguf", scale=1.0)
    a.set_factors_multi(random_factors(rank=2, seed=6))
    live = engine.logits(PROMPT)
    out = a.save(tmp_path / "saved.gguf")
    with lm.Engine.load(tiny_model, n_ctx=256, n_threads=2, loras=[str(out)]) as e2:
        assert max_diff(e2.logits(PROMPT), live) == 0.0


def test_bad_writes_are_refused_and_change_nothing(engine, tiny_dir, write_path):
    a = engine.set_lora(tiny_dir / "a.gguf")
    before = engine.logits(PROMPT)
    name = a.factor_names()[0]
    A, B = a.get_factors(name)
    cases = {
        "unknown": {"blk.9.attn_q.weight": (A, B)},
        "shape": {name: (A.T, B)},
        "rank": {name: (np.zeros((3, A.shape[1]), np.float32), np.zeros((B.shape[0], 3), np.float32))},
        "nan": {name: (A * np.nan, B)},
    }
    for label, f in cases.items():
        good = {n: a.get_factors(n) for n in a.factor_names()[1:3]}
        with pytest.raises(lm.FactorError) as ei:
            a.set_factors_multi({**good, **f})  # all-or-nothing: the good ones are not written either
        assert a.name in str(ei.value), label
    assert "rank is fixed" in str(pytest.raises(lm.FactorError, a.set_factors, name, *cases["rank"][name]).value)
    assert max_diff(engine.logits(PROMPT), before) == 0.0
    assert a.version == 0


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_refused_update_leaves_no_trace_in_later_writes(engine, tmp_path, dtype, write_path):
    # writes go through a staging mirror: a refused update must not survive in it and be
    # published by a later partial (one tensor) or full (whole-buffer copy) write
    write_tiny_lora(tmp_path / "x.gguf", seed=7, dtype=dtype)
    a = engine.load_lora(tmp_path / "x.gguf")
    orig = a.all_factors()
    names = a.factor_names()
    poisoned = {n: (A + 1, B + 1) for n, (A, B) in orig.items()}
    poisoned[names[-1]] = (orig[names[-1]][0] * np.nan, orig[names[-1]][1])
    with pytest.raises(lm.FactorError, match="NaN"):
        a.set_factors_multi(poisoned)
    assert a.version == 0
    assert all(np.array_equal(x, y) for n in names for x, y in zip(a.all_factors()[n], orig[n]))
    a.set_factors(names[0], orig[names[0]][0] * 2, orig[names[0]][1] * 2)  # exact in every dtype
    live = a.all_factors()
    assert np.array_equal(live[names[0]][0], orig[names[0]][0] * 2)
    assert all(np.array_equal(x, y) for n in names[1:] for x, y in zip(live[n], orig[n]))
    halves = {n: (A / 2, B / 2) for n, (A, B) in orig.items()}
    a.set_factors_multi(halves)
    assert all(np.array_equal(x, y) for n in names for x, y in zip(a.all_factors()[n], halves[n]))
    assert a.version == 2


def test_inputs_of_other_float_types_are_converted(engine, tmp_path, write_path):
    torch = pytest.importorskip("torch")
    write_tiny_lora(tmp_path / "x.gguf", seed=9)
    a = engine.load_lora(tmp_path / "x.gguf")
    name = a.factor_names()[0]
    A, B = random_factors(rank=2, seed=10)[name]
    a.set_factors(name, A.astype(np.float64), torch.from_numpy(B).to(torch.bfloat16))
    ga, gb = a.get_factors(name)
    assert np.array_equal(ga, A) and np.array_equal(gb, torch.from_numpy(B).to(torch.bfloat16).float().numpy())
    with pytest.raises(lm.FactorError, match="NaN or Inf"):  # finite in float64, Inf once stored as F32
        a.set_factors(name, A.astype(np.float64) * 1e300, B)
    with pytest.raises(lm.FactorError, match="floating point"):
        a.set_factors(name, A.astype(np.int32), B)
    assert np.array_equal(a.get_factors(name)[0], A)


@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_edit_views_equal_a_fresh_load(tiny_model, tmp_path, dtype, write_path):
    write_tiny_lora(tmp_path / "x.gguf", seed=13, dtype=dtype)
    new = random_factors(rank=2, seed=14)
    with lm.Engine.load(tiny_model, n_ctx=256, n_threads=2, loras=[str(tmp_path / "x.gguf")]) as eng:
        a = eng.adapter("x")
        a.set_factors_multi({n: (A * 3, B * 3) for n, (A, B) in new.items()})  # the views must see this
        with a.edit() as f:
            assert set(f) == set(a.factor_names())
            for n, (A, B) in f.items():
                assert np.array_equal(A.astype(np.float32), new[n][0] * 3 if dtype == "f32"
                                      else (new[n][0] * 3).astype(np.float16).astype(np.float32))
                A[...] = new[n][0]
                B[...] = new[n][1]
        assert a.version == 2
        edited = eng.logits(PROMPT)
    write_tiny_lora(tmp_path / "fresh.gguf", seed=14, dtype=dtype)
    with lm.Engine.load(tiny_model, n_ctx=256, n_threads=2, loras=[str(tmp_path / "fresh.gguf")]) as fresh:
        assert max_diff(edited, fresh.logits(PROMPT)) == 0.0


def test_edit_is_all_or_nothing(engine, tiny_dir, tmp_path):
    a = engine.set_lora(tiny_dir / "a.gguf")
    before, orig = engine.logits(PROMPT), a.all_factors()
    names = a.factor_names()
    with pytest.raises(lm.FactorError, match="NaN") as ei:
        with a.edit() as f:
            for A, _ in f.values():
                A *= 2
            f[names[3]][1][0, 0] = np.inf
    assert names[3] in str(ei.value)
    with pytest.raises(KeyError):
        with a.edit() as f:
            f[names[0]][0][...] = 0
            f["no.such.weight"]
    assert a.version == 0 and max_diff(engine.logits(PROMPT), before) == 0.0
    with a.edit() as f:  # nothing of the discarded edits is left in the staging copy
        assert all(np.array_equal(f[n][0], orig[n][0]) and np.array_equal(f[n][1], orig[n][1]) for n in names)
        with pytest.raises(lm.FactorError, match="edit"):  # one writer at a time, never a deadlock
            a.set_factors(names[0], *orig[names[0]])
    assert a.version == 1
    write_tiny_lora(tmp_path / "b16.gguf", seed=2, dtype="bf16")
    b16 = engine.load_lora(tmp_path / "b16.gguf")
    with pytest.raises(lm.FactorError, match="F32 or F16"):
        with b16.edit():
            pass


def test_writes_from_another_thread_are_serialized_with_generation(engine, tiny_dir):
    a = engine.set_lora(tiny_dir / "a.gguf")
    f1 = random_factors(rank=2, seed=31)
    f2 = random_factors(rank=2, seed=32)
    stop = threading.Event()
    errors: list[BaseException] = []

    def writer() -> None:
        i = 0
        while not stop.is_set():
            try:
                a.set_factors_multi(f1 if i % 2 else f2)
            except BaseException as e:  # noqa: BLE001
                errors.append(e)
                return
            i += 1
    t = threading.Thread(target=writer)
    t.start()
    try:
        for _ in range(5):
            assert engine.generate(PROMPT, max_tokens=16).finish_reason in ("stop", "length")
    finally:
        stop.set()
        t.join(60)
    assert not t.is_alive(), "the writer thread did not stop"
    assert not errors
    # every live tensor holds one whole version (never a torn mix of f1 and f2)
    final = a.all_factors()
    which = {n: ("f1" if np.array_equal(final[n][0], f1[n][0]) else "f2" if np.array_equal(final[n][0], f2[n][0]) else "?")
             for n in final}
    assert len(set(which.values())) == 1 and "?" not in which.values()


def test_write_invalidates_prefix_cache(engine, tiny_dir):
    a = engine.set_lora(tiny_dir / "a.gguf")
    g1 = engine.generate(PROMPT, max_tokens=12)
    a.set_factors_multi(random_factors(rank=2, seed=41))
    g2 = engine.generate(PROMPT, max_tokens=12)
    fresh = engine.logits(PROMPT)
    assert int(np.argmax(fresh[-1])) == (g2.tokens[0] if g2.tokens else -1) or g2.finish_reason == "stop"
    assert g1.tokens != g2.tokens


@pytest.mark.parametrize("call", ["get_factors", "all_factors", "save", "edit", "set_factors"])
def test_calls_queued_behind_a_removal_raise_instead_of_reading_freed_memory(tiny_model, tmp_path, call):
    """The open check runs where the read runs (between decodes), after a removal queued before it."""
    write_tiny_lora(tmp_path / "x.gguf", seed=31)
    eng = lm.Engine.load(tiny_model, n_ctx=128, n_threads=1, loras=[str(tmp_path / "x.gguf")])
    try:
        a = eng.adapter("x")
        name = a.factor_names()[0]
        started, release = threading.Event(), threading.Event()

        def hold() -> None:  # keeps the engine thread busy until the removal is queued behind it
            started.set()
            release.wait(30)
        busy = eng.call_async(hold)
        assert started.wait(30)
        removal = eng.call_async(lambda: eng.remove_lora("x"))
        release.set()
        A, B = random_factors(rank=2, seed=32)[name]
        actions = {
            "get_factors": lambda: a.get_factors(name),
            "all_factors": a.all_factors,
            "save": lambda: a.save(tmp_path / "out.gguf"),
            "edit": lambda: a.edit().__enter__(),
            "set_factors": lambda: a.set_factors(name, A, B),
        }
        with pytest.raises(lm.FactorError, match="unloaded"):
            actions[call]()
        busy.result(30)
        removal.result(30)
        assert "x" not in eng.adapters
        assert not (tmp_path / "out.gguf").exists()
    finally:
        eng.close()


@pytest.mark.parametrize("dtype", ["f32", "bf16"])  # F16 cannot hold such values: they become Inf (refused)
def test_writes_whose_delta_could_overflow_are_refused_like_a_load(engine, tmp_path, dtype, write_path):
    """The delta bound a load checks (max|A|·in, |alpha/r|·max|B|·r, their product ≤ 2^64) holds for
    every in-place write too: set_factors_multi (mirror and direct) and edit()."""
    write_tiny_lora(tmp_path / "x.gguf", seed=7, dtype=dtype)
    a = engine.load_lora(tmp_path / "x.gguf")
    orig = a.all_factors()
    q = next(n for n in a.factor_names() if "attn_q" in n)  # A (r, 64): narrower than ffn_down's (r, 128)
    A, B = orig[q]
    huge = {q: (np.full_like(A, 2.0 ** 40), np.full_like(B, 2.0 ** 40))}  # finite, product far over 2^64
    with pytest.raises(lm.FactorError, match="2\\^64") as ei:
        a.set_factors_multi(huge)
    assert q in str(ei.value) and a.version == 0
    if dtype != "bf16":  # edit() takes F32 and F16 adapters only
        with pytest.raises(lm.FactorError, match="2\\^64"):
            with a.edit() as f:
                f[q][0][...] = 2.0 ** 40
                f[q][1][...] = 2.0 ** 40
    assert a.version == 0
    assert all(np.array_equal(x, y) for n in orig for x, y in zip(a.all_factors()[n], orig[n]))
    # just inside the bound on this target (max|A|·64 = 1.5·2^63, B = 0), though max|A| times the
    # widest input of the adapter (128) is not: the exact per-target check lets it through
    edge = {q: (np.full_like(A, 1.5 * 2.0 ** 57), np.zeros_like(B))}
    a.set_factors_multi(edge)
    assert a.version == 1 and np.isfinite(engine.logits(PROMPT)).all()


def _count_decodes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    real = N.ContextHandle.decode

    def counted(self: N.ContextHandle, *a: object, **k: object) -> None:
        calls.append(1)
        real(self, *a, **k)
    monkeypatch.setattr(N.ContextHandle, "decode", counted)
    return calls


def test_discovery_builds_the_graph_without_a_decode(engine, tiny_dir, monkeypatch):
    """Finding where llama.cpp put an adapter's factors costs a graph build, not a decode (on the engine
    thread, where every load runs), and finds every factor: writes through them equal a fresh load."""
    calls = _count_decodes(monkeypatch)
    a = engine.call(lambda: LoRAAdapter(engine.model, tiny_dir / "a.gguf", "probe"))
    try:
        assert calls == []
        assert sorted(a.factor_tensors()) == sorted(a.targets)
        file = read_adapter_factors(tiny_dir / "a.gguf")
        for t, (fa, fb) in a.all_factors().items():  # every pointer found is the right tensor
            assert np.array_equal(fa, file[t][0]) and np.array_equal(fb, file[t][1])
    finally:
        engine.call(a.close)


def test_discovery_falls_back_to_a_decode_without_the_graph(engine, tiny_dir, monkeypatch):
    """Where llama.cpp cannot hand over the graph, one decode with an eval callback finds the same tensors."""
    ref = engine.call(lambda: LoRAAdapter(engine.model, tiny_dir / "a.gguf", "ref"))
    names = {t: (f.a_shape, f.b_shape) for t, f in ref.factor_tensors().items()}
    engine.call(ref.close)
    monkeypatch.setattr(N.ContextHandle, "graph_nodes", lambda self: None)
    calls = _count_decodes(monkeypatch)
    a = engine.call(lambda: LoRAAdapter(engine.model, tiny_dir / "a.gguf", "probe"))
    try:
        assert len(calls) == 1
        assert {t: (f.a_shape, f.b_shape) for t, f in a.factor_tensors().items()} == names
    finally:
        engine.call(a.close)


def _count_probe_contexts(monkeypatch: pytest.MonkeyPatch) -> tuple[list[int], dict[int, list[int]]]:
    """Context creations, and every adapter set each context was given (by context pointer)."""
    made: list[int] = []
    sets: dict[int, list[int]] = {}
    real_create, real_set = N.ContextHandle.create.__func__, N.ContextHandle.set_adapters

    def create(cls: type, *a: object, **k: object) -> N.ContextHandle:
        made.append(1)
        return real_create(cls, *a, **k)

    def set_adapters(self: N.ContextHandle, adapters: list, scales: list) -> bool:
        sets.setdefault(id(self), []).append(len(adapters))
        return real_set(self, adapters, scales)
    monkeypatch.setattr(N.ContextHandle, "create", classmethod(create))
    monkeypatch.setattr(N.ContextHandle, "set_adapters", set_adapters)
    return made, sets


def test_discoveries_share_the_model_probe_context(engine, tmp_path, monkeypatch):
    """Loads do not make a context each (in a busy server that was most of a cold load): the model's probe
    context serves every discovery with as many targets as the one it was made for, a new one is made for
    an adapter with more, each finds that adapter's own tensors, and the probe keeps no adapter set."""
    small = [write_tiny_lora(tmp_path / f"s{k}.gguf", seed=10 + k, targets=("blk.0.attn_q.weight",
                                                                          "blk.1.ffn_down.weight"))
             for k in range(2)]
    full = [write_tiny_lora(tmp_path / f"f{k}.gguf", seed=20 + k, rank=2 + k) for k in range(3)]
    made, sets = _count_probe_contexts(monkeypatch)
    loaded = []
    try:
        for path, n_made in [(small[0], 1), (small[1], 1), (full[0], 2), (full[1], 2), (small[0], 2),
                             (full[2], 2)]:
            a = LoRAAdapter(engine.model, path, path.stem)  # on this thread: loads run on any thread
            loaded.append(a)
            assert len(made) == n_made, f"{path.name}: {len(made)} contexts made, {n_made} expected"
            file = read_adapter_factors(path)
            assert sorted(a.factor_tensors()) == sorted(file)
            for t, (fa, fb) in a.all_factors().items():  # the pointers found are this adapter's tensors
                assert np.array_equal(fa, file[t][0]) and np.array_equal(fb, file[t][1]), (path.name, t)
        assert sets and all(s[-1] == 0 for s in sets.values())  # every look ends with no adapter set
    finally:
        for a in loaded:
            a.close()


def test_concurrent_loads_each_find_their_own_tensors(engine, tmp_path):
    """Loads on several threads at once share the probe context, one look at a time."""
    paths = [write_tiny_lora(tmp_path / f"c{k}.gguf", seed=40 + k) for k in range(6)]
    got: dict[str, LoRAAdapter] = {}
    errors: list[BaseException] = []

    def load(p: Path) -> None:
        try:
            got[p.stem] = LoRAAdapter(engine.model, p, p.stem)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
    threads = [threading.Thread(target=load, args=(p,)) for p in paths]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert not errors, errors
        for p in paths:
            file = read_adapter_factors(p)
            for t, (fa, fb) in got[p.stem].all_factors().items():
                assert np.array_equal(fa, file[t][0]) and np.array_equal(fb, file[t][1]), (p.name, t)
    finally:
        for a in got.values():
            a.close()


def test_discovery_refuses_live_factors_that_differ_from_the_file(engine, tiny_dir, monkeypatch):
    """The self-check reads a spread of targets back: a mismatch (a changed tensor layout) refuses the load."""
    real = LoRAAdapter._read

    def skewed(self: LoRAAdapter, f: object) -> tuple[np.ndarray, np.ndarray]:
        ra, rb = real(self, f)
        return ra + 1.0, rb
    monkeypatch.setattr(LoRAAdapter, "_read", skewed)
    with pytest.raises(lm.errors.BackendError, match="differ from the file"):
        engine.call(lambda: LoRAAdapter(engine.model, tiny_dir / "a.gguf", "probe"))
