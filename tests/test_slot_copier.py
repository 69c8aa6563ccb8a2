"""Slot writes beside running decodes (engine/slot_copier.py): a request whose adapter needs a slot while
other sequences decode gets it written on the copier's thread; the others keep taking steps meanwhile,
and a failed copy fails that request alone. (That a slot no token uses changes no bit of the others
whatever it holds mid-copy: tests/test_bank.py.)"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

import pytest
from tinymodel import write_tiny_lora

import loramux as lm
from loramux.cli.serve import add_parsers, settings_from_args
from loramux.engine.request import Request
from loramux.engine.slot_memory import SlotMemory
from loramux.engine.streams import TextStream
from loramux.errors import BackendError, ParameterError
from loramux.server import ServerSettings

COPIER = "loramux-slot-copy"


@pytest.fixture()
def two(tmp_path: Path) -> tuple[Path, Path]:
    return (write_tiny_lora(tmp_path / "p.gguf", rank=4, seed=21, scale=0.5),
            write_tiny_lora(tmp_path / "q.gguf", rank=4, seed=22, scale=0.5))


def _engine(model: Path, two: tuple[Path, Path], slot_writes: str = "background") -> lm.Engine:
    eng = lm.Engine.load(model, n_ctx=2048, n_parallel=2, slots=2, slot_rank=4, n_threads=1, slot_writes=slot_writes)
    eng.load_lora(two[0], "p")
    eng.load_lora(two[1], "q")
    return eng


def _tokens(fut: Future[Request]) -> list[int]:
    return list(TextStream(fut.result()).consume().tokens)


def _until(cond, what: str) -> None:  # noqa: ANN001 - a predicate
    deadline = time.monotonic() + 60
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.002)


def _spy_put(monkeypatch: pytest.MonkeyPatch, before: Callable[[str, object], None] | None = None) -> list[str]:
    """Record the thread of every SlotMemory.put; `before(thread name, block)` runs first (to hold or fail it)."""
    where: list[str] = []
    real = SlotMemory.put

    def put(self, k, t, block):  # noqa: ANN001, ANN202 - SlotMemory.put's own signature
        where.append(threading.current_thread().name)
        if before is not None:
            before(where[-1], block)
        return real(self, k, t, block)

    monkeypatch.setattr(SlotMemory, "put", put)
    return where


def _p_then_q(eng: lm.Engine, p_tokens: int = 900) -> tuple[Future[Request], Future[Request]]:
    """p's long request, decoding; then q's short one, whose slot is written beside p's decodes. (p asks for
    900 tokens: a fast host runs dozens of the tiny model's steps between two polls, and p must still be
    decoding when q is admitted and for 20 steps while q's copy is held.)"""
    long = eng.submit_async("the cat", loras={"p": 1.0}, max_tokens=p_tokens, temperature=0, ignore_eos=True)
    _until(lambda: eng.stats().decode_steps > 0, "p's request never decoded")
    return long, eng.submit_async("the dog", loras={"q": 1.0}, max_tokens=6, temperature=0, ignore_eos=True)


def test_a_slot_write_runs_beside_the_sequences_decoding(tiny_model, two, monkeypatch):
    """While q's slot copy is held on the copier's thread, p's request keeps taking decode steps; then q's
    request completes through its slot, and so does p's."""
    entered, gate = threading.Event(), threading.Event()

    def hold(thread: str, _block: object) -> None:
        if thread == COPIER:
            entered.set()
            assert gate.wait(60)

    where = _spy_put(monkeypatch, hold)
    with _engine(tiny_model, two) as eng:
        try:
            long, short = _p_then_q(eng)
            assert entered.wait(60), "q's slot was not written on the copier's thread"
            steps = eng.stats().decode_steps
            _until(lambda: eng.stats().decode_steps - steps >= 20, "p stopped decoding while q's slot was written")
        finally:
            gate.set()  # a failure above must not leave the copier (and the engine's close) waiting
        assert len(_tokens(short)) == 6 and len(_tokens(long)) == 900
        assert eng.bank is not None and eng.bank.writes == 2 and eng.stats().bank_decodes > 0
    assert where.count(COPIER) == len(where) // 2  # p's write (nothing running) inline, q's on the copier


def test_a_failed_copy_fails_its_request_alone_and_leaves_the_slot_free(tiny_model, two, monkeypatch):
    """A copy that fails on the copier's thread: q's request fails with a BackendError naming q, p's goes
    on to its end, and q's next request gets the (zeroed, free) slot written and completes."""
    failing = [True]

    def fail(thread: str, block: object) -> None:
        if failing[0] and thread == COPIER and block is not None:
            raise OSError("simulated copy failure")

    _spy_put(monkeypatch, fail)
    with _engine(tiny_model, two) as eng:
        long, bad = _p_then_q(eng)
        with pytest.raises(BackendError, match="'q'.*simulated copy failure"):
            _tokens(bad)
        assert len(_tokens(long)) == 900
        failing[0] = False
        again = eng.generate("the dog", loras={"q": 1.0}, max_tokens=6, temperature=0, ignore_eos=True)
        assert len(again.tokens) == 6
        assert eng.bank is not None and "q" in eng.bank.in_slots()


def test_slot_writes_inline_writes_at_admission_and_the_option_is_checked(tiny_model, two, monkeypatch):
    """`slot_writes="inline"` (the default; `loramux serve --slot-writes inline`): no copier; q's slot is
    written on the engine thread at its admission while p decodes. Other values are refused by name."""
    where = _spy_put(monkeypatch)
    with _engine(tiny_model, two, "inline") as eng:
        assert eng.bank is not None and eng.bank.copier is None
        long = eng.submit_async("the cat", loras={"p": 1.0}, max_tokens=60, temperature=0, ignore_eos=True)
        _until(lambda: eng.stats().decode_steps > 0, "p's request never decoded")
        q = eng.generate("the dog", loras={"q": 1.0}, max_tokens=6, temperature=0, ignore_eos=True)
        assert len(q.tokens) == 6 and len(_tokens(long)) == 60 and eng.bank.writes == 2
    assert where and set(where) == {"loramux-engine"}
    import argparse

    ap = argparse.ArgumentParser()
    add_parsers(ap.add_subparsers())
    assert settings_from_args(ap.parse_args(["serve", "--slot-writes", "inline"])).engine_options().slot_writes == "inline"
    assert settings_from_args(ap.parse_args(["serve"])).engine_options().slot_writes == "inline"
    assert settings_from_args(ap.parse_args(["serve", "--slot-writes", "background"])).engine_options(
    ).slot_writes == "background"
    with pytest.raises(ParameterError, match="slot_writes"):
        lm.EngineOptions(slot_writes="later")
    with pytest.raises(ParameterError, match="slot_writes"):
        ServerSettings(slot_writes="later").validated()
