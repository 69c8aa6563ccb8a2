"""Residency tiers of the slot bank: the warm cache (bounded LRU), slot loads from it, prefetch, no starvation."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import numpy as np
import pytest
from tinymodel import random_factors

import loramux as lm
from loramux import _native as N
from loramux.engine.adapters import LoRAAdapter
from loramux.engine.residency import Prefetcher, SlotBlocks, WarmCache
from loramux.errors import ParameterError
from loramux.gguf_io import write_adapter

PROMPTS = ["the cat sat on the mat", "a dog ran in the big red", "hello world it was", "we and you and she"]


@dataclass
class _Id:
    """What the warm cache reads of an adapter: its identity and content version."""

    uid: int
    version: int = 0
    name: str = "x"


def _blocks(uid: int, version: int = 0, nbytes: int = 1000) -> SlotBlocks:
    return SlotBlocks(uid, version, f"a{uid}", {"t": (np.zeros(nbytes // 4, np.float32)[None], np.zeros((1, 0)))})


def test_warm_cache_is_an_lru_bounded_by_bytes():
    c = WarmCache(max_bytes=3000)
    for uid in (1, 2, 3):
        c.put(_blocks(uid))
    assert c.bytes == 3000 and c.names() == ["a1", "a2", "a3"]
    assert c.get(_Id(1)) is not None  # now the most recent
    c.put(_blocks(4))
    assert c.names() == ["a3", "a1", "a4"] and c.bytes == 3000 and c.stats["evictions"] == 1
    assert c.get(_Id(2)) is None  # evicted: least recently used
    c.put(_blocks(5, nbytes=4000))  # larger than the whole budget: not kept, nothing evicted for it
    assert c.names() == ["a3", "a1", "a4"] and c.stats["too_large"] == 1
    c.discard(_Id(3))
    assert c.names() == ["a1", "a4"] and c.bytes == 2000 and len(c) == 2


def test_warm_cache_never_serves_a_stale_version():
    c = WarmCache(max_bytes=10_000)
    c.put(_blocks(1, version=0))
    assert c.get(_Id(1, version=1)) is None  # an in-place write made version 1: the blocks are stale
    c.put(_blocks(1, version=2))
    c.put(_blocks(1, version=1))  # a prefetch of version 1 finishing after version 2 was prepared
    got = c.get(_Id(1, version=2))
    assert got is not None and got.version == 2 and c.bytes == 1000


def test_warm_cache_and_engine_options_refuse_a_negative_budget():
    with pytest.raises(ParameterError, match="adapter_cache_bytes"):
        WarmCache(-1)
    with pytest.raises(ParameterError, match="adapter_cache_bytes"):
        lm.EngineOptions(adapter_cache_bytes=-1)


def test_prefetch_queue_is_bounded_and_never_blocks(monkeypatch):
    import loramux.engine.residency as R

    monkeypatch.setattr(R, "PREFETCH_QUEUE_MAX", 2)
    gate = threading.Event()

    def prepare(a):
        gate.wait(10)
        return _blocks(a.uid)
    p = Prefetcher(WarmCache(10_000), prepare)
    took = [p.submit(_Id(i)) for i in range(6)]  # the worker holds one, the queue two, the rest are dropped
    assert took[:2] == [True, True] and not all(took) and p.stats["dropped"] >= 3
    assert not p.submit(_Id(0))  # queued already
    gate.set()
    deadline = time.monotonic() + 10
    while not p.idle():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert p.cache.get(_Id(0)) is not None and not p.submit(_Id(0))  # warm now: nothing to do
    p.close()


def _slot_contents(bank, k):
    """Slot k of every target as (A rows, B columns), read back through llama.cpp."""
    out = {}
    for t in bank.targets:
        f = bank._facs[t]
        a = N.tensor_get(f.a, np.empty((bank.width, f.a_shape[1]), np.float32))
        b = N.tensor_get(f.b, np.empty((f.b_shape[0], bank.width), np.float32))
        out[t] = (a[k * bank.r:(k + 1) * bank.r].copy(), b[:, k * bank.r:(k + 1) * bank.r].copy())
    return out


def _expected(bank, adapter):
    """What slot holds for an adapter: its factors zero-padded to the slot rank, B times alpha/rank."""
    facs = adapter.all_factors()
    out = {}
    for t in bank.targets:
        f = bank._facs[t]
        a, b = np.zeros((bank.r, f.a_shape[1]), np.float32), np.zeros((f.b_shape[0], bank.r), np.float32)
        if t in facs:
            fa, fb = facs[t]
            a[:fa.shape[0]] = fa
            b[:, :fa.shape[0]] = fb * np.float32(adapter.tensor_scaling(t))
        out[t] = (a, b)
    return out


@pytest.fixture()
def three_ranks(tiny_model, tmp_path):
    """One slot of rank 4 and adapters of rank 4, 2 (on fewer targets) and 3."""
    files = [write_adapter(tmp_path / "r4.gguf", "llama", random_factors(rank=4, seed=1, scale=0.4), 4.0),
             write_adapter(tmp_path / "r2.gguf", "llama",
                           random_factors(rank=2, seed=2, scale=0.4, targets=("blk.0.attn_q.weight", "blk.1.ffn_up.weight")), 4.0),
             write_adapter(tmp_path / "r3.gguf", "llama", random_factors(rank=3, seed=3, scale=0.4), 3.0)]
    eng = lm.Engine.load(tiny_model, n_ctx=256, n_parallel=1, n_threads=1, slots=1, slot_rank=4,
                         loras=[lm.LoraSpec(str(p), 0.0, name=p.stem) for p in files])
    yield eng
    eng.close()


@pytest.mark.parametrize("warm_from_load", [True, False])
def test_slot_loads_from_warm_hold_exactly_the_adapters_factors(three_ranks, warm_from_load):
    """Adapters of falling and rising rank through one slot, each written from warm blocks the second
    time: the slot holds exactly the padded factors each time (a narrower adapter leaves no trace of
    the wider one before it). A load makes an adapter warm from its parsed file (every write a warm hit,
    the same contents as its live factors give); without that, the first write reads the live factors."""
    eng = three_ranks
    bank = eng.bank
    names = ["r4", "r2", "r3", "r4", "r2", "r3"]
    if not warm_from_load:
        eng.call(lambda: [bank.warm.discard(eng.adapter(n)) for n in names[:3]])
    for i, name in enumerate(names):
        a = eng.adapter(name)
        hits = bank.warm.stats["hits"]

        def write(a=a):
            assert bank.take_slot(a) == 0
            bank.return_slot(0)
            return _slot_contents(bank, 0), _expected(bank, a)
        got, want = eng.call(write)
        assert bank.warm.stats["hits"] == hits + (warm_from_load or i >= 3)  # the second round: warm anyway
        for t in bank.targets:
            assert np.array_equal(got[t][0], want[t][0]) and np.array_equal(got[t][1], want[t][1]), (name, t)
    assert bank.writes == len(names)


def test_an_in_place_write_is_not_served_from_stale_warm_blocks(three_ranks):
    eng = three_ranks
    bank, a = eng.bank, eng.adapter("r4")
    eng.call(lambda: (bank.take_slot(a), bank.return_slot(0)))
    eng.call(lambda: (bank.take_slot(eng.adapter("r3")), bank.return_slot(0)))  # r4 leaves the slot, stays warm
    assert bank.warm.has(a)
    t = bank.targets[0]
    fa, fb = a.get_factors(t)
    a.set_factors(t, fa * 2, fb)  # a new version
    assert not bank.warm.has(a)
    got, want = eng.call(lambda: (bank.take_slot(a), bank.return_slot(0), _slot_contents(bank, 0), _expected(bank, a))[2:])
    assert np.array_equal(got[t][0], want[t][0]) and np.array_equal(got[t][0][:4], fa * 2)


def test_adapters_of_queued_requests_are_prefetched_into_the_warm_tier(three_ranks):
    eng = three_ranks
    bank = eng.bank
    eng.call(lambda: [bank.warm.discard(eng.adapter(n)) for n in ("r2", "r3")])  # warm since their load
    toks = eng.tokenize(PROMPTS[0])
    # long enough that the prefetch, which runs between its steps, is seen well before it ends (a few ms)
    first = eng.stream(toks, loras={"r4": 1.0}, max_tokens=200, ignore_eos=True)
    queued = [eng.stream(toks, loras={n: 1.0}, max_tokens=2, ignore_eos=True) for n in ("r2", "r3")]
    deadline = time.monotonic() + 60
    while not (bank.warm.has(eng.adapter("r2")) and bank.warm.has(eng.adapter("r3"))):
        assert time.monotonic() < deadline, "queued requests' adapters were not prefetched"
        time.sleep(0.0005)  # short: a fast host decodes the 200 tokens in tens of ms
    assert len(first.request.generated) < 200  # made warm while the first request still ran
    for s in [first, *queued]:
        s.consume()
    assert bank.prefetcher.stats["prefetched"] >= 2 and bank.warm.stats["hits"] >= 2


def test_no_adapter_starves_behind_a_stream_of_requests_on_a_resident_one(tiny_model, tmp_path):
    """One slot, two sequences: requests on adapter A keep its slot busy; a request on B, queued
    behind the first, gets the slot within a bounded number of steps instead of after all of A's."""
    files = [write_adapter(tmp_path / f"{n}.gguf", "llama", random_factors(rank=2, seed=i, scale=0.3), 2.0)
             for i, n in enumerate("AB")]
    finished: list[str] = []
    with lm.Engine.load(tiny_model, n_ctx=128, n_parallel=2, n_threads=1, slots=1, slot_rank=2,
                        loras=[lm.LoraSpec(str(p), 0.0, name=p.stem) for p in files]) as eng:
        toks = eng.tokenize(PROMPTS[1])

        def submit(name, label):
            return eng.submit(toks, loras={name: 1.0}, max_tokens=40, ignore_eos=True,
                              on_event=lambda kind, _v: kind == "done" and finished.append(label))
        reqs = [submit("A", "A0"), submit("B", "B")] + [submit("A", f"A{i}") for i in range(1, 9)]
        for r in reqs:
            lm.TextStream(r).consume()
        waits = eng.scheduler.slot_wait_quantiles()
    assert finished.index("B") < 5, finished  # before: B came last, after every A
    assert waits.max_s > 0 and waits.p99_s <= waits.max_s


def _one_adapter_run(tiny_model, files, monkeypatch, native: bool, slots: int = 2):
    from loramux.engine import scheduler

    if not native:  # every decode through the bank's masks
        monkeypatch.setattr(scheduler, "_uniform", lambda entries: False)
    with lm.Engine.load(tiny_model, n_ctx=128, n_parallel=2, n_threads=1, slots=slots, slot_rank=4, kv_type="f32",
                        loras=[lm.LoraSpec(str(p), 0.0, name=p.stem) for p in files]) as eng:
        toks = eng.tokenize(PROMPTS[2])
        b1 = eng.generate(toks, loras={"B": 1.0}, max_tokens=4, ignore_eos=True).tokens  # B takes a slot
        a = [eng.generate(toks, loras={"A": 1.0}, max_tokens=30, ignore_eos=True).tokens for _ in range(2)]
        b2 = eng.generate(toks, loras={"B": 1.0}, max_tokens=4, ignore_eos=True).tokens
        alone = eng.stats().bank_decodes
        eng.generate_many([toks, toks], loras=[{"A": 1.0}, {"B": 1.0}], max_tokens=6, ignore_eos=True)
        return {"tokens": (b1, a, b2), "alone": alone, "shared": eng.stats().bank_decodes - alone}


def test_decodes_on_one_adapter_set_run_natively(tiny_model, tmp_path, monkeypatch):
    """A decode whose tokens all use one adapter set runs with that set in the graph instead of the bank
    (no K·r-wide products, no mask stops): exactly the tokens of an engine without a bank (the same
    kernels; through the masks they would agree only to rounding). Requests on different adapters still
    share decodes through the bank."""
    files = [write_adapter(tmp_path / f"{n}.gguf", "llama", random_factors(rank=4, seed=40 + i, scale=0.5), 4.0)
             for i, n in enumerate("AB")]
    native = _one_adapter_run(tiny_model, files, monkeypatch, native=True)
    no_bank = _one_adapter_run(tiny_model, files, monkeypatch, native=True, slots=0)
    masked = _one_adapter_run(tiny_model, files, monkeypatch, native=False)
    assert native["alone"] == 0 and masked["alone"] > 40
    assert native["shared"] > 0  # A and B in one decode: through the bank
    assert native["tokens"] == no_bank["tokens"]
    assert native["tokens"][1][0] != native["tokens"][0][:30]  # the adapters make a difference


def test_a_request_waits_for_a_slot_at_most_the_stated_number_of_steps(tiny_model, tmp_path):
    """docs/scaling.md, "Slot waits": a request that waits for bank slots gets them within SLOT_WAIT_STEPS
    decode steps plus the longest any request holds its slots (from its admission to its end). Two slots,
    four sequences, five adapters: a stream of requests on the two resident ones keeps both slots held
    (each may pass a waiting request while it writes no slot), so the others wait, counted in steps."""
    from loramux.engine.bank import SLOT_WAIT_STEPS

    names = "ABCDE"
    files = [write_adapter(tmp_path / f"{n}.gguf", "llama", random_factors(rank=2, seed=60 + i, scale=0.3), 2.0)
             for i, n in enumerate(names)]
    done_step: dict[int, int] = {}
    with lm.Engine.load(tiny_model, n_ctx=512, n_parallel=4, n_threads=1, slots=2, slot_rank=2,
                        loras=[lm.LoraSpec(str(p), 0.0, name=p.stem) for p in files]) as eng:
        toks = eng.tokenize(PROMPTS[0])

        def submit(i, name):
            # keyed by the request's place in `order`: on a fast host it can end before submit() returns
            def on_event(kind, _v):
                if kind == "done":
                    done_step[i] = eng.scheduler.stats.decode_steps
            return eng.submit(toks, loras={name: 1.0}, max_tokens=10, ignore_eos=True, on_event=on_event)
        order = ["A", "B", "C"] + ["A", "B"] * 12 + ["D", "E"] + ["A", "B"] * 4
        reqs = [submit(i, n) for i, n in enumerate(order)]
        for r in reqs:
            lm.TextStream(r).consume()
        reported = eng.scheduler.slot_wait_quantiles().max_steps
    waits = [r.admitted_step - r.blocked_step for r in reqs if r.blocked_step is not None]
    hold = max(done_step[i] - r.admitted_step for i, r in enumerate(reqs))
    assert max(waits) <= SLOT_WAIT_STEPS + hold, (waits, hold)  # here: 41 ≤ 32 + 10
    assert len(waits) >= 3 and max(waits) > 0  # C, D and E did wait: the bank was contended
    assert reported == max(waits)


def test_a_load_leaves_nothing_to_read_back_on_the_engine_thread(three_ranks, tmp_path, monkeypatch):
    """A loaded adapter is warm and its KV-guard gains are known, both from the file just parsed, so its
    first use reads none of its live factors back (those reads would run on the engine thread)."""
    eng = three_ranks
    reads: list[str] = []
    real = LoRAAdapter._read
    monkeypatch.setattr(LoRAAdapter, "_read", lambda self, f: (reads.append(self.name), real(self, f))[1])
    path = write_adapter(tmp_path / "fresh.gguf", "llama", random_factors(rank=4, seed=9, scale=0.4), 4.0)
    a = eng.load_lora(path, "fresh")
    assert eng.bank.warm.has(a)
    reads.clear()  # discovery's self-check reads a few targets back, on the loading thread
    eng.scheduler.guard.gains(a)
    got = eng.call(lambda: (eng.bank.take_slot(a), _slot_contents(eng.bank, 0), eng.bank.return_slot(0))[1])
    assert reads == []
    want = _expected(eng.bank, a)  # from the live factors
    for t in eng.bank.targets:
        assert np.array_equal(got[t][0], want[t][0]) and np.array_equal(got[t][1], want[t][1]), t
