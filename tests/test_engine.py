"""Engine core on real llama.cpp: adapters loaded, stacked, rescaled, removed, cleared; generation."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from conftest import PROMPT, max_diff
from tinymodel import base_shapes, random_factors, write_tiny_lora

import loramux as lm
from loramux.gguf_io import read_adapter_factors, validate_adapter, write_adapter


def test_zero_factor_adapter_is_base_exactly(engine, tiny_dir):
    base = engine.logits(PROMPT)
    engine.set_lora(tiny_dir / "zero.gguf")
    assert engine.active == {"zero": 1.0}
    assert max_diff(engine.logits(PROMPT), base) == 0.0


def test_scale_zero_remove_and_clear_are_base(engine, tiny_dir):
    base = engine.logits(PROMPT)
    engine.set_lora(tiny_dir / "a.gguf", scale=0.7)
    with_a = engine.logits(PROMPT)
    assert max_diff(with_a, base) > 1e-3
    engine.set_lora("a", scale=0.0)
    assert max_diff(engine.logits(PROMPT), base) == 0.0
    engine.set_lora("a", scale=0.7)
    assert max_diff(engine.logits(PROMPT), with_a) == 0.0
    engine.remove_lora("a")
    assert engine.active == {} and "a" not in engine.adapters
    assert max_diff(engine.logits(PROMPT), base) == 0.0
    engine.set_lora(tiny_dir / "a.gguf")
    engine.set_lora(tiny_dir / "b.gguf", scale=0.5)
    engine.clear_loras()
    assert engine.adapters == {}
    assert max_diff(engine.logits(PROMPT), base) == 0.0


def test_a_b_a_equals_fresh_a(engine, tiny_model, tiny_dir):
    engine.set_lora(tiny_dir / "a.gguf", name="x")
    first = engine.logits(PROMPT)
    engine.set_lora(tiny_dir / "b.gguf", name="x")  # replace under the same name
    assert max_diff(engine.logits(PROMPT), first) > 1e-3
    engine.set_lora(tiny_dir / "a.gguf", name="x")
    assert max_diff(engine.logits(PROMPT), first) == 0.0
    with lm.Engine.load(tiny_model, n_ctx=256, n_threads=2, loras=[lm.LoraSpec(str(tiny_dir / "a.gguf"))]) as fresh:
        assert max_diff(fresh.logits(PROMPT), first) == 0.0


def _perturbed(path, out, rel: float) -> None:
    """A copy of the adapter at `path` with every B × (1 + rel), rounded once to float32."""
    f = read_adapter_factors(path)
    alpha = validate_adapter(path).alpha
    write_adapter(out, "llama", {n: (a, (b.astype(np.float64) * (1 + rel)).astype(np.float32))
                                 for n, (a, b) in f.items()}, alpha=alpha)


def test_stacking_equals_rank_concatenation(tiny_model, tiny_dir, tmp_path):
    """Two stacked adapters == one adapter holding both ranks (scales folded into B), up to rounding.

    F32 weights (the tiny model) and an F32 KV cache, so no quantization step amplifies rounding.
    Tolerance from a noise floor measured here: the same stacked set with every B × (1 ± 1e-7)
    (an ulp-level change, the size of what folding the scales into B and re-ordering the rank sum do).
    Rule: bound = 8 × floor, never below 4 float32 ulps of the largest logit (4 · eps32 · max|logit|);
    so a floor of 0 (an ulp of B moves no logit) demands agreement to a few ulps, not exactness.
    The adapters themselves must move logits by far more than the bound, or nothing was compared.
    """
    s1, s2 = 0.6, -0.3
    a_path, b_path = tiny_dir / "a.gguf", tiny_dir / "b.gguf"
    for rel, tag in ((1e-7, "up"), (-1e-7, "down")):
        _perturbed(a_path, tmp_path / f"a_{tag}.gguf", rel)
        _perturbed(b_path, tmp_path / f"b_{tag}.gguf", rel)
    fa, fb = read_adapter_factors(a_path), read_adapter_factors(b_path)
    sa, sb = s1 * 2.0 / 2, s2 * 2.0 / 4  # scale * alpha / rank
    cat = {n: (np.concatenate([fa[n][0], fb[n][0]]), np.concatenate([fa[n][1] * sa, fb[n][1] * sb], axis=1))
           for n in fa}
    write_adapter(tmp_path / "cat.gguf", "llama", cat, alpha=6.0)  # rank 6, alpha 6: factor 1
    with lm.Engine.load(tiny_model, n_ctx=256, n_threads=2, kv_type="f32") as eng:
        def stacked(a, b) -> np.ndarray:
            eng.set_lora(a, name="a", scale=s1)
            eng.set_lora(b, name="b", scale=s2)
            assert list(eng.active) == ["a", "b"]
            return eng.logits(PROMPT)
        ref = stacked(a_path, b_path)
        floor = max(max_diff(stacked(tmp_path / f"a_{t}.gguf", tmp_path / f"b_{t}.gguf"), ref) for t in ("up", "down"))
        only_a = eng.logits(PROMPT, loras={"a": s1})
        eng.clear_loras()
        eng.set_lora(tmp_path / "cat.gguf")
        got = max_diff(eng.logits(PROMPT), ref)
    bound = max(8 * floor, 4 * float(np.finfo(np.float32).eps) * float(np.abs(ref).max()))
    assert max_diff(only_a, ref) > 100 * bound, (max_diff(only_a, ref), bound)
    assert got <= bound, f"stacked vs concatenated: {got:.3g} > bound {bound:.3g} (noise floor {floor:.3g})"


def _gen(eng: lm.Engine, loras: dict[str, float]) -> tuple[list[int], dict[str, int]]:
    """Greedy tokens of PROMPT under `loras`, and how the scheduler's counters moved for it."""
    before = eng.stats()
    tokens = eng.generate(PROMPT, max_tokens=12, ignore_eos=True, loras=loras).tokens
    after = eng.stats()
    return tokens, {k: getattr(after, k) - getattr(before, k) for k in ("prompt_tokens_reused", "batch_tokens", "prompt_tokens")}


def test_prefix_reuse_skips_the_prefix(tiny_model, tiny_dir):
    """The same request twice on one slot: the second decodes only the last prompt token again."""
    with lm.Engine.load(tiny_model, n_ctx=256, n_threads=2, kv_type="f32",
                        loras=[str(tiny_dir / "a.gguf")]) as eng:
        n = len(eng.tokenize(PROMPT))
        t1, d1 = _gen(eng, {"a": 1.0})
        t2, d2 = _gen(eng, {"a": 1.0})
        # every greedy step of t1 wins by a margin far above F32 rounding, so equal tokens are owed
        rows = eng.logits(eng.tokenize(PROMPT) + t1, loras={"a": 1.0})[n - 1:-1]
        top2 = np.sort(rows, axis=1)[:, -2:]
    assert (top2[:, 1] - top2[:, 0]).min() > 1e-3
    assert d1 == {"prompt_tokens_reused": 0, "batch_tokens": n + 11, "prompt_tokens": n}
    assert d2 == {"prompt_tokens_reused": n - 1, "batch_tokens": 1 + 11, "prompt_tokens": n}
    assert t2 == t1 and len(t1) == 12


@pytest.mark.parametrize("change", ["identity", "version", "scale"])
def test_prefix_cache_key_holds_identity_version_and_scale(tiny_model, tiny_dir, tmp_path, change):
    """KV computed under set X is never reused for set Y when Y differs from X only in `change`.

    X, then Y on the one slot (Y must recompute the whole prompt), then the base (another key), then Y
    again (recomputes it too): both Y runs are the same computation, so their tokens are equal exactly.
    A key missing the changed field would let the first Y reuse X's prefix.
    """
    write_tiny_lora(tmp_path / "c.gguf", seed=7)  # same rank, alpha and scale as a.gguf: differs by identity
    with lm.Engine.load(tiny_model, n_ctx=256, n_threads=2, loras=[str(tiny_dir / "a.gguf"),
                                                                   f"{tmp_path / 'c.gguf'}:0"]) as eng:
        a = eng.adapters["a"]
        x, y = {"a": 1.0}, {"identity": {"c": 1.0}, "version": {"a": 1.0}, "scale": {"a": 0.5}}[change]
        tx, dx = _gen(eng, x)
        if change == "version":
            a.set_factors_multi(random_factors(rank=2, seed=41))
            assert a.version == 1
        ty1, dy1 = _gen(eng, y)
        _, db = _gen(eng, {})
        ty2, dy2 = _gen(eng, y)
    assert dx["prompt_tokens_reused"] == dy1["prompt_tokens_reused"] == db["prompt_tokens_reused"] == 0
    assert dy2["prompt_tokens_reused"] == 0
    assert ty1 == ty2 and ty1 != tx


def test_per_call_set_leaves_default_untouched(engine, tiny_dir):
    engine.set_lora(tiny_dir / "a.gguf", scale=0.5)
    engine.set_lora(tiny_dir / "b.gguf", scale=0.0)
    default = engine.logits(PROMPT)
    only_b = engine.logits(PROMPT, loras={"b": 1.0})
    assert max_diff(only_b, default) > 1e-3
    assert engine.active == {"a": 0.5, "b": 0.0}
    assert max_diff(engine.logits(PROMPT), default) == 0.0
    g1 = engine.generate(PROMPT, max_tokens=8, loras={"b": 1.0})
    assert g1.loras == {"b": 1.0}
    assert engine.generate(PROMPT, max_tokens=8).loras == {"a": 0.5}
    with pytest.raises(lm.AdapterNotFoundError):
        engine.generate(PROMPT, loras={"nope": 1.0})


def test_greedy_is_deterministic_and_stream_equals_generate(engine, tiny_dir):
    engine.set_lora(tiny_dir / "a.gguf", scale=0.5)
    a = engine.generate(PROMPT, max_tokens=24)
    b = engine.generate(PROMPT, max_tokens=24)
    assert a.tokens == b.tokens and a.text == b.text and len(a.tokens) > 0
    s = engine.stream(PROMPT, max_tokens=24)
    chunks = list(s)
    assert "".join(chunks) == a.text
    assert s.completion.tokens == a.tokens
    sampled = [engine.generate(PROMPT, max_tokens=16, temperature=0.9, seed=7).tokens for _ in range(2)]
    assert sampled[0] == sampled[1]


def test_greedy_fast_path_equals_llama_cpp_greedy_sampler(engine, tiny_dir):
    # plain greedy reads the argmax in place; a no-op penalty (last_n=0) forces llama.cpp's sampler chain
    engine.set_lora(tiny_dir / "a.gguf", scale=0.5)
    fast = engine.generate(PROMPT, max_tokens=24, ignore_eos=True)
    chain = engine.generate(PROMPT, max_tokens=24, ignore_eos=True, repeat_penalty=1.5, repeat_last_n=0)
    assert fast.tokens == chain.tokens and len(fast.tokens) == 24
    batch = engine.generate_many([PROMPT, PROMPT + " again"], max_tokens=12, ignore_eos=True)
    assert batch[0].tokens == fast.tokens[:12]


def test_stop_strings_never_leak(engine):
    full = engine.generate(PROMPT, max_tokens=30).text
    assert len(full) > 6
    stop = full[3:6]
    s = engine.stream(PROMPT, max_tokens=30, stop=[stop])
    text = "".join(s)
    assert s.completion.finish_reason == "stop"
    assert stop not in text and full.startswith(text) and text == full[: full.find(stop)]


def test_chat_uses_template(engine):
    prompt = engine.apply_chat_template([{"role": "user", "content": "hello"}])
    assert prompt.startswith("<s><start_of_turn>user\nhello<end_of_turn>\n<start_of_turn>model\n")
    c = engine.chat([{"role": "user", "content": "hello"}], max_tokens=5)
    assert c.prompt_tokens == len(engine.tokenize(prompt, add_bos=False))


def test_alora_applies_only_from_invocation(engine, tiny_dir, tmp_path):
    inv = engine.tokenize(" hello world", add_bos=False)
    write_tiny_lora(tmp_path / "al.gguf", seed=5, invocation_tokens=inv)
    a = engine.load_lora(tmp_path / "al.gguf", name="al")
    assert list(a.invocation_tokens) == inv
    prefix = engine.tokenize("the cat sat")
    prompt = prefix + inv + engine.tokenize(" on the mat", add_bos=False)
    got = engine.generate(prompt, max_tokens=10, loras={"al": 1.0})
    assert got.alora == {"al": True}
    # reference: prefix without the adapter, then the rest with it, on one context
    from loramux.engine.model import Context, ContextOptions

    def ref() -> list[int]:
        ctx = Context(engine.model, ContextOptions(n_ctx=256, n_batch=64, n_threads=2))
        try:
            ctx.prefill(0, prompt[: len(prefix)])
            ctx.handle.set_adapters([a.handle], [1.0])
            row = ctx.prefill(0, prompt[len(prefix):], pos0=len(prefix))
            toks, pos = [], len(prompt)
            for _ in range(10):
                t = int(np.argmax(row[-1]))
                if engine.model.is_eog(t):
                    break
                toks.append(t)
                row = ctx.prefill(0, [t], pos0=pos)
                pos += 1
            return toks
        finally:
            ctx.close()
    assert got.tokens == engine.call(ref)
    # without the invocation sequence the adapter does not run, and the result says so
    no_inv = engine.generate("the cat sat on the mat", max_tokens=10, loras={"al": 1.0})
    base = engine.generate("the cat sat on the mat", max_tokens=10, loras={})
    assert no_inv.alora == {"al": False} and no_inv.tokens == base.tokens


def test_load_with_loras_in_order_and_all_or_nothing(tiny_model, tiny_dir):
    eng = lm.Engine.load(tiny_model, n_ctx=256, loras=[f"{tiny_dir / 'b.gguf'}:0.25", str(tiny_dir / "a.gguf")])
    try:
        assert eng.active == {"b": 0.25, "a": 1.0}
    finally:
        eng.close()
    with pytest.raises(lm.SourceError) as ei:
        lm.Engine.load(tiny_model, n_ctx=256, loras=[str(tiny_dir / "a.gguf"), str(tiny_dir / "missing.gguf")])
    assert "missing.gguf" in str(ei.value)
    with pytest.raises(lm.AdapterError) as ei2:
        lm.Engine.load(tiny_model, n_ctx=256, loras=[str(tiny_dir / "a.gguf"), str(tiny_model)])
    assert "base model" in str(ei2.value)


def test_concurrent_generations_from_threads(tiny_model, tiny_dir):
    eng = lm.Engine.load(tiny_model, n_ctx=256, n_parallel=4, loras=[str(tiny_dir / "a.gguf")])
    try:
        eng.set_lora(tiny_dir / "b.gguf", scale=0.0)
        sets = [{"a": 1.0}, {"b": 1.0}, {}, {"a": 0.5, "b": 0.5}] * 2
        solo = [eng.generate(PROMPT, max_tokens=12, loras=s).tokens for s in sets]
        out: list = [None] * len(sets)

        def run(i: int) -> None:
            out[i] = eng.generate(PROMPT, max_tokens=12, loras=sets[i]).tokens
        ts = [threading.Thread(target=run, args=(i,)) for i in range(len(sets))]
        [t.start() for t in ts]
        for th in ts:
            th.join(timeout=300)
        assert not any(th.is_alive() for th in ts), "a generate() did not return"
        # same-set requests are batched together; the tiny F32 model is batch-invariant enough here
        assert all(o is not None for o in out)
        assert sum(o == s for o, s in zip(out, solo)) >= len(sets) // 2
        assert eng.stats().decode_steps > 0
    finally:
        eng.close()


def test_random_factors_helper_shapes():
    f = random_factors(rank=3)
    a, b = f["blk.0.attn_k.weight"]
    assert a.shape == (3, 64) and b.shape == (32, 3)


def test_a_failing_request_fails_alone(tiny_model, tiny_dir, monkeypatch):
    """An error while sampling one request ends that request with a typed error; the others it shared
    decode steps with finish exactly as they would have alone."""
    from loramux.engine.scheduler import Scheduler
    from loramux.errors import RequestFailed

    eng = lm.Engine.load(tiny_model, n_ctx=256, n_parallel=3, n_threads=2, loras=[str(tiny_dir / "a.gguf")])
    try:
        eng.set_lora("a", scale=0.0)
        plans = [({"a": 1.0}, ()), ({}, ()), ({"a": 1.0}, ("BOOM",))]
        solo = [eng.generate(PROMPT, max_tokens=12, loras=s, ignore_eos=True).tokens for s, _ in plans[:2]]
        original = Scheduler._sample

        def sample(self, r, idx):  # the third request's sampling breaks after a few tokens
            if "BOOM" in tuple(r.params.stop or ()) and len(r.generated) >= 3:
                raise RuntimeError("sampler exploded")
            return original(self, r, idx)
        monkeypatch.setattr(Scheduler, "_sample", sample)
        streams = [eng.stream(PROMPT, max_tokens=12, loras=s, stop=list(stop), ignore_eos=True)
                   for s, stop in plans]
        done = [streams[0].consume().tokens, streams[1].consume().tokens]
        with pytest.raises(RequestFailed) as err:
            streams[2].consume()
        assert err.value.stage == "sample" and err.value.adapters == ["a"]
        assert done == solo
        assert eng.stats().multi_seq_steps > 0  # they really shared decodes with the failing one
        assert eng.scheduler.snapshot().running == 0
        monkeypatch.setattr(Scheduler, "_sample", original)
        assert eng.generate(PROMPT, max_tokens=12, loras={"a": 1.0}, ignore_eos=True).tokens == solo[0]
    finally:
        eng.close()


@pytest.mark.parametrize("slots", [0, 2])
def test_an_adapter_whose_output_overflows_the_kv_cache_fails_its_request_alone(tiny_model, tmp_path, slots):
    """Inside the load bound (no F32 overflow) a delta can still exceed F16's range, and the V cache would
    hold Inf. With the bank, the KV guard checks every decode of such a set, alone or shared: that request
    fails with a typed error naming the adapter, on both the greedy and the sampler path. Without one
    (no eval callback to check with) the set is refused at submit. The other request finishes as alone."""
    from loramux.errors import RequestFailed, ScaleError

    t = "blk.0.attn_v.weight"
    out_dim, in_dim = base_shapes()[t]
    hot = write_adapter(tmp_path / "hot.gguf", "llama", {t: (np.full((2, in_dim), 300, np.float32),
                                                             np.full((out_dim, 2), 300, np.float32))}, alpha=2.0)
    eng = lm.Engine.load(tiny_model, n_ctx=256, n_parallel=2, n_threads=2, slots=slots, slot_rank=4)
    try:
        eng.load_lora(hot, name="hot", scale=0.0)
        solo = eng.generate(PROMPT, max_tokens=8, ignore_eos=True).tokens
        for temperature in (0.0, 0.8):
            if not slots:
                with pytest.raises(ScaleError, match="hot × 1: its keys or values could leave"):
                    eng.stream(PROMPT, max_tokens=8, loras={"hot": 1.0}, temperature=temperature, seed=1)
                assert eng.generate(PROMPT, max_tokens=8, ignore_eos=True).tokens == solo
                continue
            streams = [eng.stream(PROMPT, max_tokens=8, loras={"hot": 1.0}, temperature=temperature, seed=1),
                       eng.stream(PROMPT, max_tokens=8, ignore_eos=True)]
            with pytest.raises(RequestFailed) as err:
                streams[0].consume()
            assert err.value.adapters == ["hot"] and "KV cache's range" in str(err.value)
            assert streams[1].consume().tokens == solo
    finally:
        eng.close()


def _constant_adapter(path, value, target="blk.0.attn_v.weight"):
    out_dim, in_dim = base_shapes()[target]
    return write_adapter(path, "llama", {target: (np.full((2, in_dim), value, np.float32),
                                                  np.full((out_dim, 2), value, np.float32))}, alpha=2.0)


def _submitted_together(eng, specs):
    """Streams for (prompt, loras, ignore_eos[, max_tokens]) specs, all queued while the engine waits, so
    that they are admitted together and share their first decode."""
    gate, inside = threading.Event(), threading.Event()
    held = eng.call_async(lambda: (inside.set(), gate.wait(30)))
    assert inside.wait(30)  # the engine thread holds the gate: the queue now counts only the submits
    out = [None] * len(specs)

    def submit(i, prompt, loras, ignore_eos, max_tokens=8):
        out[i] = eng.stream(prompt, max_tokens=max_tokens, loras=loras, ignore_eos=ignore_eos)
    threads = [threading.Thread(target=submit, args=(i, *spec)) for i, spec in enumerate(specs)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    while eng.commands.pending() < len(specs) and time.monotonic() < deadline:  # each submit is a command
        time.sleep(0.01)
    gate.set()
    held.result()
    for t in threads:
        t.join()
    return out


def test_a_request_whose_adapter_overflows_the_kv_cache_cannot_break_the_others_of_its_decode(tiny_model, tmp_path):
    """On the unified cache the bank needs, one sequence's Inf K/V cells would turn every other sequence of its
    decode NaN (masked attention computes 0·Inf). The KV guard zeroes that sequence's cells as they are written
    and fails only its request; the requests it shared decodes with return what they return alone."""
    from loramux.errors import RequestFailed

    hot = _constant_adapter(tmp_path / "hot.gguf", 300.0)
    user = write_adapter(tmp_path / "u.gguf", "llama", random_factors(rank=2, seed=7, scale=0.4), alpha=2.0)
    eng = lm.Engine.load(tiny_model, n_ctx=256, n_parallel=3, n_threads=2, slots=2, slot_rank=4)
    try:
        eng.load_lora(hot, name="hot", scale=0.0)
        eng.load_lora(user, name="u", scale=0.0)
        others = [("the dog ran", {"u": 1.0}), ("hello there", {})]
        # the reference: the same batches, with a base-model request in the hot one's place that also ends
        # after the first decode (greedy tokens are compared, so the batch shapes must match: numerics notes)
        ref = _submitted_together(eng, [(PROMPT, {}, True, 1)] + [(p, s, True) for p, s in others])
        reference = [s.consume().tokens for s in ref[1:]]
        streams = _submitted_together(eng, [(PROMPT, {"hot": 1.0}, False)] + [(p, s, True) for p, s in others])
        with pytest.raises(RequestFailed) as err:
            streams[0].consume()
        assert err.value.adapters == ["hot"] and "KV cache's range" in str(err.value)
        assert [s.consume().tokens for s in streams[1:]] == reference
        guard = eng.scheduler.guard
        assert guard.zeroed_tokens > 0 and eng.stats().multi_seq_steps > 0
        assert eng.stats().kv_guard_failures == 1 and eng.scheduler.snapshot().kv_guarded_decodes > 0
        assert eng.scheduler.snapshot().running == 0
    finally:
        eng.close()


@pytest.mark.parametrize("slots", [0, 2])
def test_an_adapter_the_kv_bound_cannot_clear_is_checked_or_refused(tiny_model, tmp_path, slots, monkeypatch):
    """An adapter whose bound could leave F16's range but whose values stay inside: with the bank its
    decodes run with the KV guard, alone and shared, which zeroes nothing and changes no token (against the
    same batches without it); without one (no eval callback) it is refused at submit, even on a unified
    cache, where its cells would reach every other sequence."""
    from loramux.engine.kv_guard import KvGuard
    from loramux.engine.registry import AdapterSet
    from loramux.errors import ScaleError

    path = _constant_adapter(tmp_path / "mild.gguf", 0.05)
    eng = lm.Engine.load(tiny_model, n_ctx=256, n_parallel=2, n_threads=2, slots=slots, slot_rank=4,
                         kv_unified=True)
    try:
        eng.load_lora(path, name="mild", scale=0.0)
        guard = eng.scheduler.guard
        g_kv, _ = guard.gains(eng.registry.get("mild"))
        scale = 2 * guard.risk_limit / (g_kv * guard.x_bound)  # twice the scale the bound clears
        assert guard.risky([AdapterSet(((eng.registry.get("mild"), scale),))])

        def pair():
            streams = _submitted_together(eng, [(p, {"mild": scale}, True, 6) for p in ("the cat sat", "a dog ran")])
            return [s.consume().tokens for s in streams]
        if slots:
            steps = eng.stats().multi_seq_steps
            with monkeypatch.context() as m:
                m.setattr(KvGuard, "risky", lambda self, sets: False)
                reference = pair()  # the same batches, unguarded
                alone = eng.generate("the cat sat", loras={"mild": scale}, max_tokens=3, ignore_eos=True).tokens
            before = guard.guarded_decodes
            assert pair() == reference
            assert guard.guarded_decodes > before and eng.stats().multi_seq_steps > steps
            before = guard.guarded_decodes
            assert eng.generate("the cat sat", loras={"mild": scale}, max_tokens=3, ignore_eos=True).tokens == alone
            assert guard.guarded_decodes == before + 3  # a single sequence too: its prefill and each token
        else:
            with pytest.raises(ScaleError, match="mild") as err:
                eng.stream("the cat sat", loras={"mild": scale}, max_tokens=6)
            assert f"|scale| ≤ {guard.safe_scale(eng.registry.get('mild')):.4g}" in str(err.value)
            assert not eng.scheduler.can_guard and eng.stats().decode_steps == 0
            assert [len(eng.generate("the cat sat", loras={"mild": scale / 4}, max_tokens=6,
                                     ignore_eos=True).tokens)] == [6]  # inside the bound it is served
        assert guard.zeroed_tokens == 0
    finally:
        eng.close()


def test_penalties_count_each_generated_token_once(engine):
    """frequency/presence penalties as OpenAI defines them: logit - f·count - p·[count > 0] over the
    tokens generated so far. Checked step by step against the raw logits (steps whose top two are within
    rounding of each other are skipped), so a token counted twice in the sampler's history shows."""
    f, p = 0.7, 0.3
    toks = engine.tokenize(PROMPT)
    out = engine.generate(toks, max_tokens=24, temperature=0.0, frequency_penalty=f, presence_penalty=p,
                          ignore_eos=True).tokens
    rows = engine.logits(toks + out[:-1])[len(toks) - 1:]
    checked = 0
    counts: dict[int, int] = {}
    for i, tok in enumerate(out):
        z = rows[i].astype(np.float64)
        for t, c in counts.items():
            z[t] -= f * c + p
        top2 = np.sort(z)[-2:]
        if top2[1] - top2[0] > 1e-3:
            assert tok == int(np.argmax(z)), i
            checked += 1
        counts[tok] = counts.get(tok, 0) + 1
    assert checked >= 16 and max(counts.values()) >= 2  # the penalties had repeats to act on
