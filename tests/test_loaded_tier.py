"""The engine's loaded tier (engine/residency.py): `max_loaded` bounds what llama.cpp holds, the least
recently used adapter no request uses is evicted, and a request's adapters become loaded and in use in one
engine-thread step (so no request is ever retried because another one's load evicted its adapter)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from tinymodel import random_factors

import loramux as lm
from loramux.engine.residency import LruPolicy
from loramux.errors import AdapterCapacityError, ParameterError
from loramux.gguf_io import write_adapter

PROMPT = "the cat sat on the mat"
NAMES = ("a", "b", "c", "d")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("tier")
    return {n: write_adapter(d / f"{n}.gguf", "llama", random_factors(rank=2, seed=10 + i, scale=0.5), 2.0)
            for i, n in enumerate(NAMES)}


def _texts(tiny_model, files) -> dict[str, str]:
    """Each adapter's greedy output on an unbounded engine: what the bounded one must give exactly."""
    with lm.Engine.load(tiny_model, n_ctx=128, n_threads=1) as eng:
        for n, p in files.items():
            eng.load_lora(p, n)
        return {n: eng.generate(PROMPT, loras={n: 1.0}, max_tokens=8).text for n in files}


def test_lru_policy_picks_the_least_recently_used_candidate():
    p: LruPolicy[str] = LruPolicy()
    for k in "xyz":
        p.touch(k)
    p.touch("x")
    assert p.order() == ["y", "z", "x"] and p.victim(["x", "z"]) == "z"
    assert p.victims(["x", "y", "z", "new"], 2) == ["new", "y"]  # never touched counts as oldest
    p.forget("y")
    assert p.oldest() == "z" and p.victim([]) is None


def test_max_loaded_is_an_engine_option_checked_like_the_others(tiny_model):
    assert lm.EngineOptions(max_loaded=2).max_loaded == 2
    with pytest.raises(ParameterError) as e:
        lm.EngineOptions(max_loaded=0)
    assert e.value.parameter == "max_loaded"


def test_third_adapter_evicts_the_least_recently_used_and_comes_back_on_demand(tiny_model, files):
    want = _texts(tiny_model, files)
    with lm.Engine.load(tiny_model, n_ctx=128, n_threads=1, max_loaded=2) as eng:
        eng.load_lora(files["a"], "a")
        eng.load_lora(files["b"], "b")
        assert eng.generate(PROMPT, loras={"a": 1.0}, max_tokens=8).text == want["a"]  # a: used after b
        eng.load_lora(files["c"], "c")
        assert sorted(eng.adapters) == ["a", "c"] and set(eng.loaded.cold) == {"b"}
        assert eng.generate(PROMPT, loras={"b": 1.0}, max_tokens=8).text == want["b"]  # loaded again
        assert sorted(eng.adapters) == ["b", "c"]  # a was the least recently used then
        assert eng.loaded.stats["evictions"] == 2 and eng.loaded.stats["reloads"] == 1
        eng.set_lora("a", 0.5)  # activating an evicted adapter by name loads it again (evicting c)
        assert sorted(eng.adapters) == ["a", "b"] and eng.active == {"a": 0.5}
        eng.generate(PROMPT, loras={"b": 1.0}, max_tokens=1)  # b used after a
        eng.load_lora(files["c"], "c")  # a is the least recently used, but active: b goes
        assert sorted(eng.adapters) == ["a", "c"]
        eng.set_lora("a", 0.0)
        assert eng.generate(PROMPT, loras={"b": 1.0}, max_tokens=8).text == want["b"]  # a (scale 0 now) goes
        assert sorted(eng.adapters) == ["b", "c"]
        eng.remove_lora("a")  # an evicted adapter can be unloaded: nothing of it stays
        assert "a" not in eng.loaded.cold
        with pytest.raises(lm.AdapterNotFoundError):
            eng.generate(PROMPT, loras={"a": 1.0}, max_tokens=2)


def test_an_adapter_in_use_is_never_evicted_the_request_waits_instead(tiny_model, files):
    """The engine thread is held while three submits queue: a and c go in use (queued requests), b was
    evicted and finds no idle adapter to evict, so it waits, never taking a or c from under their requests,
    and runs once they finish."""
    with lm.Engine.load(tiny_model, n_ctx=256, n_threads=1, max_loaded=2) as eng:
        for n in ("a", "b"):
            eng.load_lora(files[n], n)
        eng.generate(PROMPT, loras={"a": 1.0}, max_tokens=1)
        eng.load_lora(files["c"], "c")
        assert set(eng.loaded.cold) == {"b"}
        gate = threading.Event()
        eng.call_async(gate.wait)
        long = {"max_tokens": 60, "ignore_eos": True}
        futs = [eng.submit_async(PROMPT, loras={n: 1.0}, **long) for n in ("a", "c", "b")]
        seen = eng.call_async(lambda: (sorted(eng.registry.adapters), len(eng.loaded.waiting), futs[2].done()))
        gate.set()
        assert seen.result() == (["a", "c"], 1, False)
        done = [lm.TextStream(f.result()).consume() for f in futs]
        assert [len(c.tokens) for c in done] == [60, 60, 60]
        assert eng.loaded.stats["waited"] == 1 and eng.loaded.stats["peak"] == 2
        assert sorted(eng.adapters) in (["a", "b"], ["b", "c"])


def test_many_requests_over_more_adapters_than_max_loaded_all_complete(tiny_model, files):
    """24 requests from 8 threads over 4 adapters with room for 2: every one completes with exactly its
    adapter's output, adapters are evicted and loaded again, and no more than 2 are ever loaded."""
    want = _texts(tiny_model, files)
    with lm.Engine.load(tiny_model, n_ctx=128, n_parallel=2, n_threads=1, max_loaded=2) as eng:
        for n in ("a", "b"):
            eng.load_lora(files[n], n)
        for n in ("c", "d"):  # known, then evicted: they come back on demand
            eng.load_lora(files[n], n)
        order = [NAMES[(i * 3) % 4] for i in range(24)]
        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(lambda n: (n, eng.generate(PROMPT, loras={n: 1.0}, max_tokens=8).text), order))
        assert len(got) == 24 and all(text == want[n] for n, text in got)
        st = eng.loaded.stats
        assert st["reloads"] >= 2 and st["evictions"] >= 4 and st["peak"] == 2, st
        assert len(eng.adapters) <= 2 and not eng.loaded.waiting


def test_a_set_that_can_never_fit_is_refused_and_pinned_adapters_stay(tiny_model, files):
    with lm.Engine.load(tiny_model, n_ctx=128, n_threads=1, max_loaded=2) as eng:
        eng.load_lora(files["a"], "a", pin=True)
        eng.load_lora(files["b"], "b")
        eng.load_lora(files["c"], "c")  # evicts b, never the pinned a
        assert sorted(eng.adapters) == ["a", "c"]
        with pytest.raises(AdapterCapacityError) as e:  # a stays, so b and c cannot both be loaded
            eng.generate(PROMPT, loras={"b": 1.0, "c": 1.0}, max_tokens=2)
        assert e.value.max_loaded == 2 and e.value.kept == ["a"]
        eng.load_lora(files["d"], "d", pin=True)  # evicts c
        with pytest.raises(AdapterCapacityError):  # two pinned fill the bound: no third load
            eng.load_lora(files["b"], "b2")
        assert sorted(eng.adapters) == ["a", "d"]


def test_written_in_place_is_never_evicted_and_an_evaluation_loads_an_evicted_adapter(tiny_model, files):
    """An adapter written in place no longer equals its file: evicting it would lose the write, so the
    tier keeps it. `Engine.loss` on an evicted adapter loads it again, like a request does."""
    with lm.Engine.load(tiny_model, n_ctx=128, n_threads=1) as ref:
        ref.load_lora(files["b"], "b")
        want = ref.loss(PROMPT, loras={"b": 1.0})
    with lm.Engine.load(tiny_model, n_ctx=128, n_threads=1, max_loaded=2) as eng:
        eng.load_lora(files["a"], "a")
        eng.load_lora(files["b"], "b")
        a = eng.adapter("a")
        t = a.factor_names()[0]
        fa, fb = a.get_factors(t)
        a.set_factors(t, fa * 0.5, fb)  # a is the least recently used, but written
        eng.load_lora(files["c"], "c")
        assert sorted(eng.adapters) == ["a", "c"] and set(eng.loaded.cold) == {"b"}
        assert eng.loss(PROMPT, loras={"b": 1.0}) == want  # loaded again (c evicted, never a)
        assert sorted(eng.adapters) == ["a", "b"]
