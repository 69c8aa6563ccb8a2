"""llama.cpp's model-wide adapter set (`llama_model::loras`) is touched by an adapter load, a free and a
context's graph reserve; `_native` serializes exactly those, so loads may run on any thread while the
engine thread decodes. Real llama.cpp on the suite's tiny model; the load is held inside
`llama_adapter_lora_init` (the binding's own function, wrapped) to see what waits for it."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import llama_cpp.llama_cpp as C
import pytest
from conftest import PROMPT

from loramux import _native as N
from loramux.engine.adapters import LoRAAdapter
from loramux.engine.model import Context, ContextOptions


def hold_loads(monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event, threading.Event]:
    """Every adapter load from now on waits inside llama_adapter_lora_init (the binding's function, wrapped)
    until `gate` is set; `inside` is set once one is there."""
    inside, gate = threading.Event(), threading.Event()
    real = C.llama_adapter_lora_init

    def held(*a: object) -> object:
        inside.set()
        assert gate.wait(60)
        return real(*a)
    monkeypatch.setattr(C, "llama_adapter_lora_init", held)
    return inside, gate


@contextmanager
def load_held(monkeypatch: pytest.MonkeyPatch, model: N.ModelHandle, path: str,
              out: list[N.AdapterHandle]) -> Iterator[None]:
    """An adapter load on another thread, held inside llama_adapter_lora_init until the block ends; its
    handle goes into `out` (the caller closes it, whatever happened)."""
    inside, gate = hold_loads(monkeypatch)
    t = threading.Thread(target=lambda: out.append(N.AdapterHandle.load(model, path)))
    t.start()
    assert inside.wait(60)
    try:
        yield
    finally:
        gate.set()
        t.join(60)


def _finish_order(fn, release_after: float) -> list[str]:  # noqa: ANN001
    """Run fn on a thread for up to `release_after` s: ['done', 'released'] if it finished by then."""
    order: list[str] = []
    t = threading.Thread(target=lambda: (fn(), order.append("done")))
    t.start()
    t.join(release_after)
    order.append("released")
    t.join(60)
    return order


def test_a_free_and_a_context_creation_wait_for_a_load_on_another_thread(engine, tiny_dir, monkeypatch):
    other = engine.call(lambda: LoRAAdapter(engine.model, tiny_dir / "b.gguf", "other"))
    loaded: list[N.AdapterHandle] = []
    made: list[Context] = []
    t = threading.Thread(target=lambda: made.append(Context(engine.model, ContextOptions(n_ctx=64, n_batch=8))))
    try:
        with load_held(monkeypatch, engine.model.handle, str(tiny_dir / "a.gguf"), loaded):
            assert other.close(wait=False) is False  # the engine thread's try: the load holds the set
            assert not other.handle.closed
            t.start()
            t.join(0.3)
            assert not made, "a context was created while a load held the model's adapter set"
        t.join(60)
        assert made and loaded
        assert other.close(wait=False) is True and other.handle.closed
    finally:
        if t.is_alive():
            t.join(60)
        for c in made:
            c.close()
        other.close()
        for h in loaded:
            h.close()


def test_only_a_decode_that_re_reserves_waits_for_a_load(engine, tiny_dir, monkeypatch):
    """The first decode after an adapter-set change re-reserves the graph (reads the model's set): it waits
    for a load in progress; a decode on an unchanged set does not."""
    a = engine.call(lambda: LoRAAdapter(engine.model, tiny_dir / "a.gguf", "a"))
    ctx = Context(engine.model, ContextOptions(n_ctx=64, n_batch=8))
    toks = engine.tokenize(PROMPT)
    loaded: list[N.AdapterHandle] = []
    try:
        ctx.prefill(0, toks)
        with load_held(monkeypatch, engine.model.handle, str(tiny_dir / "b.gguf"), loaded):
            steady = _finish_order(lambda: (ctx.handle.memory_clear(), ctx.prefill(0, toks)), release_after=30)
            ctx.handle.set_adapters([a.handle], [1.0])
            started = time.monotonic()
            changed_order: list[str] = []
            t = threading.Thread(target=lambda: (ctx.handle.memory_clear(), ctx.prefill(0, toks),
                                                 changed_order.append("done")))
            t.start()
            t.join(0.3)
            changed_order.append("released")
        t.join(60)
        assert steady == ["done", "released"]
        assert changed_order == ["released", "done"], "the re-reserving decode ran while a load held the set"
        assert time.monotonic() - started >= 0.3 and loaded
    finally:
        ctx.close()
        engine.call(a.close)
        for h in loaded:
            h.close()


def test_close_waits_for_a_load_on_another_thread_and_refuses_later_ones(tiny_model, tiny_dir, monkeypatch):
    """Engine.close() lets a load already inside llama.cpp on another thread finish and be published (then
    frees it with the rest) before the model goes; a load asked for after close() began is refused."""
    import loramux as lm

    eng = lm.Engine.load(tiny_model, n_ctx=256, n_threads=1)
    inside, gate = hold_loads(monkeypatch)
    got: list[object] = []
    loader = threading.Thread(target=lambda: got.append(eng.load_lora(tiny_dir / "a.gguf", "late")))
    loader.start()
    assert inside.wait(60)
    closer = threading.Thread(target=eng.close)
    try:
        closer.start()
        closer.join(0.3)
        closing_waited = closer.is_alive()
    finally:
        gate.set()
        loader.join(60)
        closer.join(60)
    assert closing_waited, "close() went on while a load was inside llama.cpp"
    assert len(got) == 1 and got[0].handle.closed  # published, then freed by close()
    with pytest.raises(lm.errors.EngineClosedError):
        eng.load_lora(tiny_dir / "b.gguf", "after")


def test_an_adapter_held_past_its_model_is_freed_with_it(tiny_model, tiny_dir):
    """llama.cpp frees a model's adapters with the model: an adapter a caller still holds (public API:
    `Model`, `LoRAAdapter`) is freed before the model goes, reads as unloaded afterwards, and its own
    late free (garbage collection) does nothing. In a child process: the failure is a crash."""
    code = f"""
import gc, loramux as lm
from loramux.errors import FactorError
model = lm.Model({str(tiny_model)!r})
kept = lm.LoRAAdapter(model, {str(tiny_dir / 'a.gguf')!r}, "kept")
gone = lm.LoRAAdapter(model, {str(tiny_dir / 'b.gguf')!r}, "gone")
gone.close()
model.close()
assert kept.handle.closed and gone.handle.closed
try:
    kept.get_factors(kept.targets[0])
except FactorError as e:
    print("refused:", e)
del kept, gone
gc.collect()
print("survived")
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "refused:" in run.stdout and "unloaded" in run.stdout and run.stdout.rstrip().endswith("survived")
