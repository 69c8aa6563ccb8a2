"""Slot bank: mixed-adapter batches through per-token masks, against native padded controls."""

from __future__ import annotations

import numpy as np
import pytest
from tinymodel import random_factors

from loramux.engine.adapters import LoRAAdapter
from loramux.engine.bank import SlotBank, token_scales
from loramux.engine.model import Context, ContextOptions, Model
from loramux.errors import BackendError
from loramux.gguf_io import write_adapter

K, R = 4, 4
PROMPTS = ["the cat sat on the mat", "a dog ran in the big red", "hello world it was", "we and you and she"]


@pytest.fixture()
def setup(tiny_model, tmp_path):
    model = Model(tiny_model)
    bank = SlotBank(model, K, R)
    users = []
    for i, rank in enumerate([2, 4, 3]):
        f = random_factors(rank=rank, seed=100 + i, scale=0.4)
        p = write_adapter(tmp_path / f"u{i}.gguf", "llama", f, alpha=float(rank))
        users.append(LoRAAdapter(model, p, f"u{i}"))
    yield model, bank, users, tmp_path
    for u in users:
        u.close()
    bank.close()
    model.close()


def _ctx(model, callback=None):
    return Context(model, ContextOptions(n_ctx=512, n_batch=64, n_ubatch=64, n_seq_max=4, n_threads=2,
                                         kv_unified=True), callback=callback)


def _run_batch(ctx, model, seq_tokens, before=None):
    ctx.clear()
    ctx.batch.clear()
    for s, toks in enumerate(seq_tokens):
        ctx.batch.add(toks, 0, s, [False] * (len(toks) - 1) + [True])
    if before:
        before()
    ctx.handle.decode(ctx.batch)
    return [ctx.handle.logits_row(i) for i in np.nonzero(ctx.batch.logits[: ctx.batch.n])[0]]


def _padded(bank, user, slot, path):
    """The control: a native rank-K·R adapter with `user` in `slot` and zeros elsewhere."""
    facs = user.all_factors()
    out = {}
    for t in bank.targets:
        o, i = bank.model.tensor_shapes[t]
        a = np.zeros((bank.width, i), np.float32)
        b = np.zeros((o, bank.width), np.float32)
        if t in facs:
            a[slot * R: slot * R + user.rank] = facs[t][0]
            b[:, slot * R: slot * R + user.rank] = facs[t][1]
        out[t] = (a, b)
    return LoRAAdapter(bank.model, write_adapter(path, "llama", out, 0.0), "padded")


def test_mixed_batch_is_bit_identical_to_padded_controls(setup):
    model, bank, users, tmp = setup
    slots = [bank.acquire(u) for u in users]
    assert sorted(slots) == [0, 1, 2]
    # seq 0..2 use users 0..2 at scale 1 (alpha == rank, so the mask value is exactly 1); seq 3 none
    seq_tokens = [model.tokenize(p) for p in PROMPTS]
    wants = [[(slots[0], 1.0)], [(slots[1], 1.0)], [(slots[2], 1.0)], []]
    ctx = _ctx(model, bank.callback)
    ctx.handle.set_adapters([bank.adapter.handle], [1.0])
    out_flags = np.concatenate([[0] * (len(t) - 1) + [1] for t in seq_tokens]) != 0

    def plan():
        bank.set_plan(token_scales(bank, [(len(t), w) for t, w in zip(seq_tokens, wants)]), out_flags)
    mixed = _run_batch(ctx, model, seq_tokens, plan)
    bank.check()
    ctx.close()
    plain = _ctx(model)
    for i, u in enumerate(users):
        pad = _padded(bank, u, slots[i], tmp / f"pad{i}.gguf")
        plain.handle.set_adapters([pad.handle], [1.0])
        control = _run_batch(plain, model, seq_tokens)
        assert np.array_equal(mixed[i], control[i]), f"seq {i}"
        native = LoRAAdapter(model, u.path, "native")
        plain.handle.set_adapters([native.handle], [1.0])
        nat = _run_batch(plain, model, seq_tokens)
        assert np.abs(nat[i] - mixed[i]).max() < 1e-3  # float rounding only: other matmul kernel
        plain.handle.set_adapters([], [])
        pad.close()
        native.close()
    base = _run_batch(plain, model, seq_tokens)
    assert np.array_equal(base[3], mixed[3])  # no adapters: exactly the base path
    assert not np.array_equal(base[0], mixed[0])
    plain.close()


def test_masks_stay_right_across_decodes_and_batch_shapes(setup):
    """The callback caches node views per memory place: later decodes, other shapes, other slots."""
    model, bank, users, tmp = setup
    slots = [bank.acquire(u) for u in users]
    seq_tokens = [model.tokenize(p) for p in PROMPTS]
    ctx = _ctx(model, bank.callback)
    ctx.handle.set_adapters([bank.adapter.handle], [1.0])
    plain = _ctx(model)
    controls = []
    for i, u in enumerate(users):
        pad = _padded(bank, u, slots[i], tmp / f"pad{i}.gguf")
        plain.handle.set_adapters([pad.handle], [1.0])
        controls.append(_run_batch(plain, model, seq_tokens))
        plain.handle.set_adapters([], [])  # before close: the context must not keep a freed adapter
        pad.close()
    controls.append(_run_batch(plain, model, seq_tokens))  # index 3: no adapter
    # user index per sequence (3 = none); the short batch in between changes every node's shape
    for users_of in ([0, 1, 2, 3], [3, 0, 1, 2], None, [2, 3, 0, 1], [2, 3, 0, 1]):
        toks = seq_tokens if users_of is not None else [t[:3] for t in seq_tokens]
        assign = users_of or [0, 1, 2, 3]
        wants = [[(slots[j], 1.0)] if j < 3 else [] for j in assign]
        flags = np.concatenate([[0] * (len(t) - 1) + [1] for t in toks]) != 0
        scales = token_scales(bank, [(len(t), w) for t, w in zip(toks, wants)])
        got = _run_batch(ctx, model, toks, lambda s=scales, f=flags: bank.set_plan(s, f))
        bank.check()
        if users_of is not None:
            for s, j in enumerate(assign):
                assert np.array_equal(got[s], controls[j][s]), (users_of, s)
    ctx.close()
    plain.close()


def test_slot_lru_pinning_and_rewrite(setup):
    model, bank, users, tmp = setup
    extra = [LoRAAdapter(model, users[0].path, f"x{i}") for i in range(3)]
    try:
        k0 = bank.pin(users[0])
        ks = [bank.acquire(u) for u in [users[1], users[2], extra[0]]]
        assert None not in ks and k0 not in ks
        assert bank.acquire(extra[1]) is None  # every slot busy (one pinned, three referenced)
        bank.release(ks[0])  # users[1] idle now: the least recently used idle slot is evicted
        k = bank.acquire(extra[1])
        assert k == ks[0] and bank.slot_of(users[1]) is None
        assert bank.slot_of(users[0]) == k0  # pinned stays
        # an in-place write to a user adapter makes its slot stale; the next acquire rewrites
        bank.release(ks[1])
        users[2].set_factors_multi(random_factors(rank=3, seed=999))
        assert bank.slot_of(users[2]) is None
        before = bank.writes
        assert bank.acquire(users[2]) is not None and bank.writes == before + 1
    finally:
        for e in extra:
            e.close()


def test_mask_check_fails_loudly_on_plan_mismatch(setup):
    model, bank, users, _ = setup
    ctx = _ctx(model, bank.callback)
    ctx.handle.set_adapters([bank.adapter.handle], [1.0])
    toks = model.tokenize(PROMPTS[0])

    def wrong_plan():  # planned for a different number of tokens than the batch holds
        bank.set_plan(np.zeros((len(toks) + 3, K), np.float32), np.array([True] + [False] * (len(toks) + 2)))
    _run_batch(ctx, model, [toks], wrong_plan)
    with pytest.raises(BackendError, match="bank nodes"):
        bank.check()
    ctx.close()


# ---------------------------------------------------------------------------------- through the engine

SETS = [{"u0": 1.0}, {"u1": 1.0}, {}, {"u2": 0.7}, {"u0": 0.5, "u1": 0.5}]


@pytest.fixture()
def bank_engine(tiny_model, tmp_path):
    import loramux as lm

    paths = []
    for i, rank in enumerate([2, 4, 3]):
        f = random_factors(rank=rank, seed=200 + i, scale=0.5)
        paths.append(str(write_adapter(tmp_path / f"u{i}.gguf", "llama", f, alpha=float(rank))))
    eng = lm.Engine.load(tiny_model, n_ctx=128, n_parallel=8, n_batch=128, n_threads=2, slots=4, slot_rank=4,
                         loras=[lm.LoraSpec(p, 0.0) for p in paths])
    yield eng
    eng.close()


def _own_set_scores_best(eng, prompt_toks, comp, own):
    toks = prompt_toks + comp.tokens
    mask = [False] * len(prompt_toks) + [True] * len(comp.tokens)
    scores = [eng.loss_sum([toks], loras=s, masks=[mask])[0] for s in SETS]
    best = min(range(len(SETS)), key=lambda i: scores[i])
    return best == own


def test_mixed_requests_share_decodes_and_keep_their_adapters(bank_engine):
    eng = bank_engine
    prompts = ["the cat sat on the mat", "a dog ran in the big red", "hello world it was", "we and you and she",
               "she ran and the dog"] * 2
    sets = SETS * 2
    toks = [eng.tokenize(p) for p in prompts]
    out = eng.generate_many(toks, loras=sets, max_tokens=12, ignore_eos=True)
    steps_mixed = eng.stats()["decode_steps"]
    solo = [eng.generate(t, loras=s, max_tokens=12, ignore_eos=True) for t, s in zip(toks, sets)]
    assert steps_mixed < sum(len(c.tokens) for c in out)  # sequences really shared decode steps
    good = sum(_own_set_scores_best(eng, t, c, i % len(SETS)) for i, (t, c) in enumerate(zip(toks, out)))
    assert good >= len(out) - 1, good
    same = sum(a.tokens == b.tokens for a, b in zip(out, solo))
    assert same >= len(out) // 2  # batch-variance may flip a few greedy tokens; most agree
    assert sorted(eng.bank.resident()) == ["u0", "u1", "u2"]


def test_slot_rewritten_in_place_is_used_by_next_request(bank_engine, tiny_model, tmp_path):
    import loramux as lm

    eng = bank_engine
    toks = eng.tokenize("the cat sat on the mat")
    before = eng.generate(toks, loras={"u1": 1.0}, max_tokens=10, ignore_eos=True).tokens
    new = random_factors(rank=4, seed=777, scale=0.5)
    eng.adapter("u1").set_factors_multi(new)
    after = eng.generate(toks, loras={"u1": 1.0}, max_tokens=10, ignore_eos=True).tokens
    assert after != before
    p = write_adapter(tmp_path / "fresh.gguf", "llama", new, alpha=4.0)
    with lm.Engine.load(tiny_model, n_ctx=128, n_parallel=8, n_batch=128, n_threads=2, slots=4, slot_rank=4,
                        loras=[lm.LoraSpec(str(p), 0.0, name="u1")]) as fresh:
        assert fresh.generate(toks, loras={"u1": 1.0}, max_tokens=10, ignore_eos=True).tokens == after


def test_adapter_too_big_for_a_slot_is_served_the_ordinary_way(bank_engine, tmp_path):
    eng = bank_engine
    p = write_adapter(tmp_path / "big.gguf", "llama", random_factors(rank=8, seed=5, scale=0.3), alpha=8.0)
    eng.load_lora(p, name="big")
    toks = eng.tokenize("the cat sat on the mat")
    c = eng.generate(toks, loras={"big": 1.0}, max_tokens=8, ignore_eos=True)
    assert "big" not in eng.bank.resident()
    first = int(np.argmax(eng.logits(toks, loras={"big": 1.0})[-1]))
    assert c.tokens[0] == first
