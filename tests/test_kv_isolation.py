"""No request can change another's output through the KV cache.

The attack: an allowed scale on a loaded adapter (`lora: [{"name": "pirate", "scale": ...}]`) whose keys
and values overflow the F16 KV cache. Without the KV guard its Inf cells stay behind: a failed request's
cells are freed but keep their data, and non-flash attention reads every cell of the padded window,
masked (0·Inf = NaN), so every later request of every tenant broke. Each test runs that attack and then
base, chat and adapter requests one at a time, and compares their tokens with those of a fresh engine
(or server) with the same settings that never saw it (the same batches, so exact equality holds:
numerics notes).

The settings are those of `loramux serve --parallel 1` (no bank), `--parallel 4` (a slot bank of 4, its
KV guard) and `--parallel 4 --slots 0` (no bank, one KV stream per sequence).
"""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from tinymodel import N_LAYER, random_factors

import loramux as lm
from loramux.engine.kv_guard import KvGuard, folded_gain, target_gain
from loramux.errors import RequestFailed, ScaleError
from loramux.gguf_io import write_adapter
from loramux.server import LoraEntry, ServerSettings, create_app, serve_in_thread

ATTACK = "Hello there, " * 40
HOT = 1000.0  # the largest scale the server takes; the K/V then overflow F16 (the guard sees them: below)
SETTINGS = {"parallel 1": {"n_parallel": 1, "slots": 0}, "parallel 4": {"n_parallel": 4, "slots": 4},
            "slots 0": {"n_parallel": 4, "slots": 0}}
SERVE = {"parallel 1": {"parallel": 1}, "parallel 4": {"parallel": 4}, "slots 0": {"parallel": 4, "slots": 0}}


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory, tiny_dir: Path) -> Path:
    """'pirate': a plain random rank-2 adapter on every attn_k and attn_v; 'a': the suite's adapter."""
    d = tmp_path_factory.mktemp("kv_isolation")
    targets = tuple(f"blk.{i}.{p}.weight" for i in range(N_LAYER) for p in ("attn_k", "attn_v"))
    write_adapter(d / "pirate.gguf", "llama", random_factors(rank=2, seed=5, scale=1.5, targets=targets), alpha=2.0)
    shutil.copy(tiny_dir / "a.gguf", d / "a.gguf")
    return d


@contextmanager
def engine(model: Path, adir: Path, setting: str, **options: object) -> Iterator[lm.Engine]:
    with lm.Engine.load(model, n_ctx=512, n_threads=2, slot_rank=8, **SETTINGS[setting], **options) as eng:
        eng.load_lora(adir / "pirate.gguf", name="pirate", scale=0.0)
        eng.load_lora(adir / "a.gguf", name="a", scale=0.0)
        yield eng


def follow_ups(eng: lm.Engine) -> list[list[int]]:
    """Base, chat and adapter requests, one at a time (the long one covers the attack's cells)."""
    return [eng.generate("the cat sat on the mat", max_tokens=8, ignore_eos=True).tokens,
            eng.generate(ATTACK + "the dog", max_tokens=8, ignore_eos=True).tokens,
            eng.chat([{"role": "user", "content": "hello world"}], max_tokens=8, ignore_eos=True).tokens,
            eng.generate("the dog ran", loras={"a": 1.0}, max_tokens=8, ignore_eos=True).tokens,
            eng.generate("we and you", loras={"pirate": 1.0}, max_tokens=8, ignore_eos=True).tokens]


@pytest.fixture(scope="module")
def fresh(tiny_model: Path, adapters: Path) -> dict[str, list[list[int]]]:
    """The follow-ups' tokens on a fresh engine of each setting."""
    out = {}
    for setting in SETTINGS:
        with engine(tiny_model, adapters, setting) as eng:
            out[setting] = follow_ups(eng)
    return out


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_the_attack_leaves_every_later_request_as_on_a_fresh_engine(tiny_model, adapters, fresh, setting):
    """With a bank the KV guard checks every decode of the risky set, even alone: it zeroes the cells as they
    are written and fails only that request. Without one nothing could check it, so it is refused before
    anything is decoded. Either way nothing is cleared afterwards: nothing was left to clear."""
    with engine(tiny_model, adapters, setting) as eng:
        if eng.scheduler.can_guard:
            with pytest.raises(RequestFailed, match="KV cache's range") as err:
                eng.generate(ATTACK, loras={"pirate": HOT}, max_tokens=1)
            assert err.value.adapters == ["pirate"]
            assert eng.scheduler.guard.zeroed_tokens > 0  # its K/V really left F16's range
            assert eng.stats().kv_guard_failures == 1
        else:
            with pytest.raises(ScaleError, match=r"pirate × 1000: its keys or values could leave the f16"):
                eng.generate(ATTACK, loras={"pirate": HOT}, max_tokens=1)
            assert eng.stats().decode_steps == 0
        assert follow_ups(eng) == fresh[setting]
        assert eng.stats().kv_clears == 0


@pytest.mark.parametrize(("kv_type", "flash_attn"), [("f16", True), ("f32", False)])
def test_the_guard_follows_the_cache_type_and_layout(tiny_model, adapters, kv_type, flash_attn):
    """Flash attention keeps V untransposed (another layout of the KV writes): the guard zeroes the cells
    there too. An F32 cache holds the attack's values: no stop, no failure. Later requests as fresh."""
    with engine(tiny_model, adapters, "parallel 4", kv_type=kv_type, flash_attn=flash_attn) as eng:
        want = follow_ups(eng)
    with engine(tiny_model, adapters, "parallel 4", kv_type=kv_type, flash_attn=flash_attn) as eng:
        guard = eng.scheduler.guard
        if kv_type == "f16":
            with pytest.raises(RequestFailed, match="f16 KV cache's range"):
                eng.generate(ATTACK, loras={"pirate": HOT}, max_tokens=1)
            assert guard.zeroed_tokens > 0
        else:
            assert len(eng.generate(ATTACK, loras={"pirate": HOT}, max_tokens=1).tokens) == 1
            assert guard.guarded_decodes == 0
        assert follow_ups(eng) == want


@pytest.mark.parametrize("setting", ["parallel 1", "parallel 4"])
def test_an_adapter_written_past_the_bound_while_its_request_runs_is_stopped_before_it_decodes_again(
        tiny_model, adapters, fresh, setting):
    """Risk is decided per decode, not only at admission: an in-place write that scales the running request's
    adapter up 1600-fold makes its set risky. With the bank its next decodes run with the guard; without one
    it fails before its next decode, with the refusal's error. The later requests: a fresh engine's."""
    with engine(tiny_model, adapters, setting) as eng:
        pirate = eng.adapter("pirate")
        before = pirate.all_factors()
        running = eng.stream("the cat sat", loras={"pirate": 1.0}, max_tokens=400, ignore_eos=True)
        pirate.set_factors_multi({t: (a * 40, b * 40) for t, (a, b) in before.items()})
        with pytest.raises((RequestFailed, ScaleError)) as err:
            running.consume()
        assert ("KV cache's range" if eng.scheduler.can_guard else "pirate × 1: its keys or values could leave") \
            in str(err.value)
        pirate.set_factors_multi(before)
        assert follow_ups(eng) == fresh[setting] and eng.stats().kv_clears == 0


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_cells_that_got_past_the_guard_are_cleared_when_their_request_fails(tiny_model, adapters, fresh, setting,
                                                                           monkeypatch):
    """Defence in depth: should out-of-range K/V ever enter the cache unchecked (here: the bound says no set
    is risky), the request fails on its non-finite logits, and the cache's K/V data is cleared before
    anything can read the cells it left."""
    monkeypatch.setattr(KvGuard, "risky", lambda self, sets: False)
    with engine(tiny_model, adapters, setting) as eng:
        with pytest.raises(RequestFailed, match="not finite") as err:
            eng.generate(ATTACK, loras={"pirate": HOT}, max_tokens=1)
        assert err.value.adapters == ["pirate"] and eng.scheduler.guard.guarded_decodes == 0
        assert eng.stats().kv_clears == 1
        assert follow_ups(eng) == fresh[setting]


def test_on_a_shared_cache_the_requests_that_read_unchecked_cells_fail_and_later_ones_are_clean(
        tiny_model, adapters, fresh, monkeypatch):
    """A unified cache: cells that got past the guard reach every sequence running beside them. Those fail
    with an error that says so (instead of returning what they computed from them), and the cache is
    cleared; the requests after them get a fresh engine's tokens."""
    monkeypatch.setattr(KvGuard, "risky", lambda self, sets: False)
    with engine(tiny_model, adapters, "parallel 4") as eng:
        hot, beside = submitted_together(eng, [(ATTACK, {"pirate": HOT}, 1), ("the cat sat on the mat", {}, 50)])
        with pytest.raises(RequestFailed, match="not finite"):
            hot.consume()
        with pytest.raises(RequestFailed, match="another request left non-finite keys or values") as err:
            beside.consume()
        assert err.value.adapters == [] and "retry the request" in str(err.value)
        assert eng.stats().kv_clears == 1 and eng.scheduler.snapshot().running == 0
        assert follow_ups(eng) == fresh["parallel 4"]


def test_on_per_sequence_streams_a_stream_with_unchecked_cells_is_used_again_only_once_cleared(
        tiny_model, adapters, fresh, monkeypatch):
    """One KV stream per sequence (--slots 0): cells that got past the guard reach no other running
    sequence, so those run on, but nothing is admitted to that stream until no request runs and the
    cache's data has been cleared."""
    monkeypatch.setattr(KvGuard, "risky", lambda self, sets: False)
    with engine(tiny_model, adapters, "slots 0") as eng:
        hot, beside = submitted_together(eng, [(ATTACK, {"pirate": HOT}, 1), ("the cat sat on the mat", {}, 400)])
        with pytest.raises(RequestFailed, match="not finite"):
            hot.consume()
        assert eng.call(lambda: set(eng.scheduler.quarantined)) == {hot.request.seq}  # `beside` still runs
        meanwhile = eng.stream("the dog ran", loras={"a": 1.0}, max_tokens=8, ignore_eos=True)
        assert len(meanwhile.consume().tokens) == 8 and meanwhile.request.seq != hot.request.seq
        assert len(beside.consume().tokens) == 400 and eng.stats().kv_clears == 0
        assert follow_ups(eng) == fresh["slots 0"]  # admitting the first of them cleared the cache
        assert eng.stats().kv_clears == 1 and not eng.scheduler.quarantined


def submitted_together(eng: lm.Engine, specs: list[tuple[str, dict, int]]) -> list[lm.TextStream]:
    """Streams for (prompt, loras, max_tokens), queued while the engine waits, so that they are admitted
    together, in this order, and share their first decode."""
    gate, inside = threading.Event(), threading.Event()
    held = eng.call_async(lambda: (inside.set(), gate.wait(30)))
    assert inside.wait(30)  # the engine thread holds the gate: the queue now counts only the submits
    out: list = [None] * len(specs)
    threads: list[threading.Thread] = []

    def submit(i: int) -> None:
        prompt, loras, n = specs[i]
        out[i] = eng.stream(prompt, loras=loras, max_tokens=n, ignore_eos=True)
    for i in range(len(specs)):  # one after the other: each submit is one engine command, run in order
        t = threading.Thread(target=submit, args=(i,))
        t.start()
        deadline = time.monotonic() + 10
        while eng.commands.pending() < i + 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        threads.append(t)
    gate.set()
    held.result()
    for t in threads:
        t.join()
    return out


def test_an_evaluation_on_a_risky_set_leaves_the_next_evaluation_alone(tiny_model, adapters):
    """Engine.logits/loss run in their own context, without a guard: a risky set's cells are zeroed
    before the next evaluation, which then equals a fresh engine's."""
    with engine(tiny_model, adapters, "parallel 1") as eng:
        want = eng.logits("the cat sat on the mat", loras={})
    with engine(tiny_model, adapters, "parallel 1") as eng:
        assert not np.isfinite(eng.logits(ATTACK, loras={"pirate": HOT})).all()
        assert np.array_equal(eng.logits("the cat sat on the mat", loras={}), want)


def test_the_folded_bound_holds_for_the_worst_input_and_is_never_wider_than_the_plain_one():
    """g with the norm weight folded into A: no input the norm can give (||x̂||₂ ≤ √n, x = w ⊙ x̂ + b) gets
    a larger |Δ_i| than it says (the worst x̂ for row i, in closed form), and it is never wider than the plain
    bound ||A_j||₂·||x||₂ with ||x||₂ ≤ √n·max|w| + ||b||₂."""
    rng = np.random.default_rng(0)
    for trial in range(20):
        r, n, out = rng.integers(1, 9), rng.integers(4, 65), rng.integers(1, 33)
        a, b = rng.standard_normal((r, n)), rng.standard_normal((out, r))
        w, bias = rng.standard_normal(n) * rng.uniform(0.1, 50), rng.standard_normal(n) * (trial % 2)
        scaling = rng.uniform(0.1, 4)
        g = folded_gain(a, b, scaling, w, bias, int(n))
        rows = scaling * b @ (a * w)  # Δ = rows·x̂ + scaling·B·A·bias, the worst x̂ = √n·rows_i/||rows_i||
        worst = np.sqrt(n) * np.linalg.norm(rows, axis=1) + np.abs(scaling * b @ (a @ bias))
        assert worst.max() <= g * (1 + 1e-9), trial
        plain = target_gain(a, b, scaling) * (np.sqrt(n) * np.abs(w).max() + np.linalg.norm(bias))
        assert g <= plain * (1 + 1e-9), trial


# ---------------------------------------------------------------------------------- through HTTP
@contextmanager
def served(model: Path, adir: Path, setting: str) -> Iterator[tuple[object, lm.Engine]]:
    """`loramux serve` with these settings: the engine its settings build, the app, uvicorn on 127.0.0.1."""
    cfg = ServerSettings(model=str(model), n_ctx=512, threads=2, **SERVE[setting],
                         loras=(LoraEntry("pirate", str(adir / "pirate.gguf")), LoraEntry("a", str(adir / "a.gguf"))))
    eng = cfg.build_engine()
    try:
        app = create_app(eng, cfg, own_engine=True)
    except BaseException:
        eng.close()
        raise
    with serve_in_thread(app) as srv:
        yield srv, eng


def http_follow_ups(srv: object) -> list[list[int]]:
    c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    extra = {"ignore_eos": True, "return_token_ids": True}
    out = []
    for model, prompt in (("tiny", "the cat sat on the mat"), ("tiny", ATTACK + "the dog"), ("a", "the dog ran"),
                          ("pirate", "we and you")):
        r = c.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0, extra_body=extra)
        out.append(r.choices[0].model_extra["token_ids"])
    r = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hello world"}], max_tokens=8,
                                  temperature=0, extra_body=extra)
    out.append(r.choices[0].model_extra["token_ids"])
    return out


@pytest.mark.parametrize("setting", ["parallel 4", "parallel 1"])
def test_the_attack_through_the_server_leaves_every_later_request_as_on_a_fresh_server(tiny_model, adapters,
                                                                                       setting):
    """The reproduction as a client sends it. With the bank (--parallel 4) the request fails with
    request_failed naming the KV cache; without one (--parallel 1) it is refused with a 400 naming the scale.
    Then every later request's tokens are a fresh server's."""
    with served(tiny_model, adapters, setting) as (srv, eng):
        want = http_follow_ups(srv)
    with served(tiny_model, adapters, setting) as (srv, eng):
        r = httpx.post(srv.url + "/v1/completions", timeout=120, json={
            "model": "pirate", "prompt": ATTACK, "max_tokens": 1, "lora": [{"name": "pirate", "scale": HOT}]})
        body = r.json()["error"]
        if setting == "parallel 4":
            assert r.status_code == 500 and body["code"] == "request_failed" and "KV cache's range" in body["message"]
            assert eng.scheduler.guard.zeroed_tokens > 0
        else:
            assert r.status_code == 400 and body["code"] == "invalid_scale" and body["param"] == "lora"
            assert "pirate × 1000" in body["message"] and "|scale| ≤" in body["message"]
        assert http_follow_ups(srv) == want
        assert eng.stats().kv_clears == 0
