"""The factor writer as a state machine: idle → staging → published or restored, closed when unloaded.

Races are made deterministic with a `Gate`: an array-like whose conversion blocks until released, so a
write can be held in the middle of its fill (STAGING, inside its section between decodes) while another
writer, a removal or a close arrives. Each race runs with an engine (the hop between decodes) and
without one (the writer's own lock is then all that serialises).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import PROMPT
from tinymodel import random_factors, write_tiny_lora

import loramux as lm
from loramux.engine import factor_stage
from loramux.engine.adapters import LoRAAdapter
from loramux.engine.factor_writer import WriterState
from loramux.engine.model import Model
from loramux.errors import EngineClosedError, FactorError, FactorStateError

Factors = dict[str, tuple[np.ndarray, np.ndarray]]


class Gate:
    """An array whose conversion waits for `go`: holds a write mid-fill, with the writer STAGING."""

    def __init__(self, arr: np.ndarray) -> None:
        self.arr, self.shape, self.dtype = arr, arr.shape, arr.dtype
        self.entered, self.go = threading.Event(), threading.Event()

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        self.entered.set()
        assert self.go.wait(60), "the gate was never opened"
        return self.arr if dtype is None else self.arr.astype(dtype)


def gated(factors: Factors) -> tuple[dict[str, tuple[Any, Any]], Gate]:
    """`factors` with the A of the middle target behind a Gate (targets before it are filled first)."""
    names = list(factors)
    mid = names[len(names) // 2]
    gate = Gate(factors[mid][0])
    return {n: ((gate, b) if n == mid else (a, b)) for n, (a, b) in factors.items()}, gate


class Background:
    """Run `fn` on a thread; keep its result or its exception."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.result: Any = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self.thread.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self.result = fn()
        except BaseException as e:  # noqa: BLE001 - inspected by the test
            self.error = e

    def join(self) -> None:
        self.thread.join(60)
        assert not self.thread.is_alive(), "the thread did not finish (a deadlock?)"


def same(x: Factors, y: Factors) -> bool:
    return x.keys() == y.keys() and all(np.array_equal(x[n][0], y[n][0]) and np.array_equal(x[n][1], y[n][1])
                                        for n in x)


@pytest.fixture(params=["mirror", "direct"])
def write_path(request, monkeypatch):
    """Small adapters are staged in a mirror, large ones written tensor by tensor: race both."""
    if request.param == "direct":
        monkeypatch.setattr(factor_stage, "MIRROR_MAX_BYTES", 0)
    return request.param


class Host:
    """An adapter with an engine (writes hop between decodes) or without one (the writer's lock alone)."""

    def __init__(self, kind: str, model_path: Path, adapter_path: Path) -> None:
        self.kind = kind
        self.engine: lm.Engine | None = None
        self.model: Model | None = None
        if kind == "engine":
            self.engine = lm.Engine.load(model_path, n_ctx=128, n_threads=1)
            self.adapter = self.engine.load_lora(adapter_path, name="x")
        else:
            self.model = Model(model_path)
            self.adapter = LoRAAdapter(self.model, adapter_path, "x")

    def remove(self) -> None:
        if self.engine is not None:
            self.engine.remove_lora("x")
        else:
            self.adapter.close()

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
        else:
            self.adapter.close()
            assert self.model is not None
            self.model.close()


@pytest.fixture(params=["engine", "no-engine"])
def host(request, tiny_model, tmp_path) -> Iterator[Host]:
    write_tiny_lora(tmp_path / "x.gguf", seed=51)
    h = Host(request.param, tiny_model, tmp_path / "x.gguf")
    yield h
    h.close()


def test_states_follow_the_documented_transitions(engine, tmp_path):
    write_tiny_lora(tmp_path / "x.gguf", seed=52)
    a = engine.load_lora(tmp_path / "x.gguf")
    w = a.writer
    orig = a.all_factors()
    new = random_factors(rank=2, seed=53)
    names = a.factor_names()
    assert w.state is WriterState.IDLE and a.version == 0

    a.set_factors_multi(new)  # idle → staging → published
    assert w.state is WriterState.PUBLISHED and a.version == 1 and same(a.all_factors(), new)

    bad = dict(new)
    bad[names[-1]] = (new[names[-1]][0], np.full_like(new[names[-1]][1], np.nan))
    with pytest.raises(FactorError, match="NaN") as ei:  # published → staging → restored
        a.set_factors_multi(bad)
    assert not isinstance(ei.value, FactorStateError)  # refused for its values, not for the state
    assert w.state is WriterState.RESTORED and a.version == 1 and same(a.all_factors(), new)

    with a.edit() as f:  # restored → staging, for the whole with-block
        assert w.state is WriterState.STAGING
        with pytest.raises(FactorStateError, match="edit\\(\\) block") as busy:
            a.set_factors_multi(orig)  # staging → staging: refused at once, never waits
        assert (busy.value.state, busy.value.action, busy.value.adapter) == ("staging", "write", "x")
        with pytest.raises(FactorStateError) as again:
            a.edit().__enter__()  # a second block: refused at once too
        assert (again.value.state, again.value.action) == ("staging", "edit")
        for n in names:
            f[n][0][...] = orig[n][0]
            f[n][1][...] = orig[n][1]
    assert w.state is WriterState.PUBLISHED and a.version == 2 and same(a.all_factors(), orig)

    with pytest.raises(RuntimeError, match="changed my mind"):
        with a.edit() as f:  # staging → restored: the block raised, nothing is published
            f[names[0]][0][...] = 7.0
            raise RuntimeError("changed my mind")
    assert w.state is WriterState.RESTORED and a.version == 2 and same(a.all_factors(), orig)

    engine.remove_lora(a.name)  # → closed, final
    assert w.state is WriterState.CLOSED
    for step, action in ((lambda: a.set_factors_multi(new), "write"), (lambda: a.edit().__enter__(), "edit")):
        with pytest.raises(FactorStateError, match="unloaded") as gone:
            step()
        assert (gone.value.state, gone.value.action) == ("closed", action)
    assert w.state is WriterState.CLOSED


def test_an_edit_finished_after_its_adapter_closed_publishes_nothing(host):
    a = host.adapter
    cm = a.edit()
    views = cm.__enter__()
    for A, _ in views.values():
        A[...] = 1.0
    host.remove()  # staging → closed
    with pytest.raises((FactorStateError, EngineClosedError)) as ei:
        cm.__exit__(None, None, None)
    assert a.writer.state is WriterState.CLOSED
    if isinstance(ei.value, FactorStateError):
        assert (ei.value.state, ei.value.action) == ("closed", "publish")


def test_concurrent_writers_are_serialised_and_whole(host, write_path):
    """Two threads write the same adapter: one waits for the other, neither is torn, none is lost."""
    a = host.adapter
    f1, f2 = random_factors(rank=2, seed=61), random_factors(rank=2, seed=62)
    held, gate = gated(f1)
    first = Background(lambda: a.set_factors_multi(held))
    assert gate.entered.wait(60)  # the first write is mid-fill, the writer STAGING
    assert a.writer.state is WriterState.STAGING
    second = Background(lambda: a.set_factors_multi(f2))
    second.thread.join(0.3)
    done_early = not second.thread.is_alive()
    gate.go.set()
    first.join()
    second.join()
    assert first.error is None and second.error is None, (first.error, second.error)
    assert not done_early, "the second write finished while the first was still filling"
    assert a.version == 2  # each write counted once
    assert a.writer.state is WriterState.PUBLISHED
    assert same(a.all_factors(), f2)  # the later one whole, nothing of the first left in any tensor


def test_many_writers_leave_one_whole_version(host, write_path):
    a = host.adapter
    sets = [random_factors(rank=2, seed=70 + i) for i in range(4)]
    threads = [Background(lambda s=s: [a.set_factors_multi(s) for _ in range(10)]) for s in sets]
    for t in threads:
        t.join()
    assert [t.error for t in threads] == [None] * 4
    assert a.version == 40
    final = a.all_factors()
    assert sum(same(final, s) for s in sets) == 1  # exactly one of the writes, every tensor of it


def test_a_write_racing_a_remove_completes_first_or_fails_typed(host, tmp_path):
    a = host.adapter
    new = random_factors(rank=2, seed=81)
    held, gate = gated(new)
    w = Background(lambda: a.set_factors_multi(held))
    assert gate.entered.wait(60)
    rm = Background(host.remove)  # arrives while the write is mid-fill
    rm.thread.join(0.3)
    removed_early = not rm.thread.is_alive()
    gate.go.set()
    w.join()
    rm.join()
    assert rm.error is None
    assert not removed_early, "the adapter was freed under a write being filled"
    assert w.error is None and w.result is None  # it was first: it completed, whole
    assert a.writer.state is WriterState.CLOSED and a.version == 1
    with pytest.raises(FactorStateError, match="unloaded") as ei:  # after the remove: typed, nothing written
        a.set_factors_multi(new)
    assert (ei.value.state, ei.value.action) == ("closed", "write")
    if host.engine is not None:  # the engine serves on, the adapter gone
        assert "x" not in host.engine.adapters
        assert host.engine.generate(PROMPT, max_tokens=4).finish_reason in ("stop", "length")


def test_a_remove_then_write_leaves_serving_intact(tiny_model, tiny_dir, tmp_path):
    """The other order, with an engine: the removal queued first; the write then fails typed and the
    other adapters and the base serve exactly as before."""
    write_tiny_lora(tmp_path / "x.gguf", seed=82)
    with lm.Engine.load(tiny_model, n_ctx=128, n_threads=1) as eng:
        a = eng.load_lora(tmp_path / "x.gguf")
        eng.load_lora(tiny_dir / "b.gguf", name="y")
        base0 = eng.generate(PROMPT, max_tokens=8, loras={}).tokens
        y0 = eng.generate(PROMPT, max_tokens=8, loras={"y": 1.0}).tokens
        started, release = threading.Event(), threading.Event()

        def hold() -> None:  # the engine busy until the removal is queued behind it
            started.set()
            release.wait(30)
        busy = eng.call_async(hold)
        assert started.wait(30)
        removal = eng.call_async(lambda: eng.remove_lora("x"))
        release.set()
        with pytest.raises(FactorStateError) as ei:
            a.set_factors_multi(random_factors(rank=2, seed=83))
        assert ei.value.state == "closed"
        busy.result(30)
        removal.result(30)
        assert "x" not in eng.adapters
        assert eng.generate(PROMPT, max_tokens=8, loras={}).tokens == base0
        assert eng.generate(PROMPT, max_tokens=8, loras={"y": 1.0}).tokens == y0


def test_a_write_racing_engine_close_completes_or_fails_typed(tiny_model, tmp_path):
    write_tiny_lora(tmp_path / "x.gguf", seed=91)
    eng = lm.Engine.load(tiny_model, n_ctx=128, n_threads=1)
    a = eng.load_lora(tmp_path / "x.gguf")
    new = random_factors(rank=2, seed=92)
    held, gate = gated(new)
    w = Background(lambda: a.set_factors_multi(held))
    assert gate.entered.wait(60)
    closing = Background(eng.close)
    closing.thread.join(0.3)
    closed_early = not closing.thread.is_alive()
    gate.go.set()
    w.join()
    closing.join()
    assert closing.error is None and not closed_early, "the engine closed under a write being filled"
    assert w.error is None and a.version == 1  # it held the engine: it completed first
    assert a.writer.state is WriterState.CLOSED
    with pytest.raises(EngineClosedError):  # after the close: typed
        a.set_factors_multi(new)


@pytest.mark.parametrize("fault", ["shape", "nan", "unknown", "raises"])
def test_a_failed_write_restores_the_previous_factors_exactly(engine, tmp_path, fault, write_path):
    write_tiny_lora(tmp_path / "x.gguf", seed=95)
    a = engine.load_lora(tmp_path / "x.gguf", scale=1.0)
    a.set_factors_multi(random_factors(rank=2, seed=96))
    before, tokens = a.all_factors(), engine.generate(PROMPT, max_tokens=8).tokens
    new = random_factors(rank=2, seed=97)
    names = list(new)
    last = names[-1]  # every target before it is filled first
    if fault == "shape":
        new[last] = (new[last][0][:1], new[last][1])
    elif fault == "nan":
        new[last] = (new[last][0], np.full_like(new[last][1], np.nan))
    elif fault == "unknown":
        new["blk.9.no_such.weight"] = new[last]
    else:
        class Boom:
            shape = new[last][0].shape

            def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
                raise RuntimeError("the source of this array failed")
        new[last] = (Boom(), new[last][1])
    with pytest.raises((FactorError, RuntimeError)):
        a.set_factors_multi(new)
    assert a.writer.state is WriterState.RESTORED and a.version == 1
    assert same(a.all_factors(), before)
    assert engine.generate(PROMPT, max_tokens=8).tokens == tokens
    if a.dtype in ("F32", "F16"):  # the staging copy holds the live values again, not the refused ones
        with a.edit():
            pass
        assert same(a.all_factors(), before) and engine.generate(PROMPT, max_tokens=8).tokens == tokens


def test_a_write_nested_between_decodes_does_not_wait_for_the_engine(tiny_model, tmp_path):
    """Work between decodes on a caller's thread may write factors (a push does) even when a command
    is queued meanwhile: the nested write runs inline; a hop would wait for the engine thread that
    this caller holds."""
    write_tiny_lora(tmp_path / "x.gguf", seed=98)
    engine = lm.Engine.load(tiny_model, n_ctx=128, n_threads=1)
    a = engine.load_lora(tmp_path / "x.gguf")
    new = random_factors(rank=2, seed=99)
    queued: list[Any] = []

    def section() -> tuple[bool, int]:
        inline = threading.current_thread() is not engine_thread
        queued.append(engine.call_async(lambda: None))  # the engine thread now waits for this section
        a.set_factors_multi(new)
        return inline, a.version
    engine_thread = engine.call(threading.current_thread)
    t = Background(lambda: engine.call_between_decodes(section))
    t.thread.join(60)
    if t.thread.is_alive():  # the engine is left stuck: not closed, so the suite goes on
        pytest.fail("the nested write waited for the engine its caller holds (a deadlock)")
    try:
        assert t.error is None and t.result == (True, 1)  # ran on this thread (the idle engine held), inline
        queued[0].result(30)
        assert same(a.all_factors(), new)
    finally:
        engine.close()


def test_only_the_writer_stages_factors():
    """The staging primitives (the mirror, direct-write encoding) are the writer's alone: any other
    module that imports them has a second way to change an adapter's factors."""
    import ast

    root = Path(lm.__file__).parent
    staging = {"Mirror", "encode"}
    users = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").endswith("factor_stage"):
                if staging & {a.name for a in node.names}:
                    users.append(str(path.relative_to(root)))
    assert users == ["engine/factor_writer.py"]
