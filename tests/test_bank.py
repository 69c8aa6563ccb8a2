"""Slot bank: mixed-adapter batches through per-token masks, against native padded controls."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest
from tinymodel import base_shapes, random_factors

from loramux import _native as N
from loramux.engine.adapters import LoRAAdapter
from loramux.engine.bank import SlotBank, token_scales
from loramux.engine.kv_guard import KvGuard
from loramux.engine.model import Context, ContextOptions, Model
from loramux.engine.registry import AdapterSet
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
    slots = [bank.take_slot(u) for u in users]
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
    slots = [bank.take_slot(u) for u in users]
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
        k0 = bank.pin_slot(users[0])
        ks = [bank.take_slot(u) for u in [users[1], users[2], extra[0]]]
        assert None not in ks and k0 not in ks
        assert bank.take_slot(extra[1]) is None  # every slot busy (one pinned, three referenced)
        bank.return_slot(ks[0])  # users[1] idle now: the least recently used idle slot is evicted
        k = bank.take_slot(extra[1])
        assert k == ks[0] and bank.slot_of(users[1]) is None
        assert bank.slot_of(users[0]) == k0  # pinned stays
        # an in-place write to a user adapter makes its slot stale; the next acquire rewrites
        bank.return_slot(ks[1])
        users[2].set_factors_multi(random_factors(rank=3, seed=999))
        assert bank.slot_of(users[2]) is None
        before = bank.writes
        assert bank.take_slot(users[2]) is not None and bank.writes == before + 1
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


def test_an_unplanned_or_failed_mask_never_leaves_the_bank_unmasked(setup, monkeypatch):
    """A decode nobody planned, or a mask that fails, zeroes the bank's nodes (exactly the base model
    for everyone) instead of applying every slot to every sequence; a failed mask also fails check()."""
    from loramux.engine import bank as bank_mod

    model, bank, users, _ = setup
    for u in users:
        bank.take_slot(u)
    toks = [model.tokenize(p) for p in PROMPTS]
    ctx, plain = _ctx(model, bank.callback), _ctx(model)
    try:
        base = _run_batch(plain, model, toks)
        ctx.handle.set_adapters([bank.adapter.handle], [1.0])
        got = _run_batch(ctx, model, toks)  # no set_plan
        assert bank.unplanned == len(bank.targets)
        assert all(np.array_equal(g, b) for g, b in zip(got, base))

        def broken(self, x):
            raise FloatingPointError("mask broke")
        monkeypatch.setattr(bank_mod.Mask, "apply", broken)
        flags = np.concatenate([[0] * (len(t) - 1) + [1] for t in toks]) != 0
        scales = token_scales(bank, [(len(t), [(0, 1.0), (1, 1.0)]) for t in toks])
        got = _run_batch(ctx, model, toks, lambda: bank.set_plan(scales, flags))
        with pytest.raises(BackendError, match="mask broke"):
            bank.check()
        assert all(np.array_equal(g, b) for g, b in zip(got, base))
    finally:
        ctx.close()
        plain.close()


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
    steps_mixed = eng.stats().decode_steps
    solo = [eng.generate(t, loras=s, max_tokens=12, ignore_eos=True) for t, s in zip(toks, sets)]
    assert steps_mixed < sum(len(c.tokens) for c in out)  # sequences really shared decode steps
    good = sum(_own_set_scores_best(eng, t, c, i % len(SETS)) for i, (t, c) in enumerate(zip(toks, out)))
    assert good >= len(out) - 1, good
    same = sum(a.tokens == b.tokens for a, b in zip(out, solo))
    assert same >= len(out) // 2  # batch-variance may flip a few greedy tokens; most agree
    assert sorted(eng.bank.in_slots()) == ["u0", "u1", "u2"]


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
    assert "big" not in eng.bank.in_slots()
    first = int(np.argmax(eng.logits(toks, loras={"big": 1.0})[-1]))
    assert c.tokens[0] == first


# ------------------------------------------------------------------ every adapter shape against native
#
# Each shape is compared with the native load of the same file, on the tiny model's F32 weights with an
# F32 KV cache, against a noise floor measured in the same test: the same native comparison with every
# B scaled by (1 + 1e-7). The bank's arithmetic differs from llama.cpp's native LoRA only by a few
# roundings of each delta (the rank zero-padded to the slot rank sums in another order; alpha/rank is
# folded into B instead of scaling B·A·x; the request scale multiplies A·x), each about the size of that
# perturbation. TOL_FLOORS floors leave room for those few roundings; an actual error (a wrong per-tensor
# scaling, a missing or stale row) moves the logits by more than 1000·TOL_FLOORS floors, which each
# comparison also checks, so it could see one.

TOL_FLOORS = 32
QV = tuple(n for n in base_shapes() if n.split(".")[2] in ("attn_q", "attn_v"))


@dataclass
class Shape:
    factors: dict[str, tuple[np.ndarray, np.ndarray]]
    alpha: float
    scale: float = 1.0
    dtype: str = "f32"


def _f32_ctx(model, callback=None):
    return Context(model, ContextOptions(n_ctx=512, n_batch=64, n_ubatch=64, n_seq_max=4, n_threads=2,
                                         kv_unified=True, kv_type="f32"), callback=callback)


def _every_logit(ctx, seq_tokens, before=None) -> list[np.ndarray]:
    """One batch of every sequence; each sequence's logits at every position (n_tok, n_vocab)."""
    ctx.clear()
    ctx.batch.clear()
    for s, toks in enumerate(seq_tokens):
        ctx.batch.add(toks, 0, s, True)
    if before:
        before()
    ctx.handle.decode(ctx.batch)
    rows = np.array([ctx.handle.logits_row(i) for i in range(ctx.batch.n)])
    ends = np.cumsum([len(t) for t in seq_tokens])
    return np.split(rows, ends[:-1])


def _per_layer(ranks: dict[str, int], default: int, seed: int, scale: float = 0.3,
               targets: tuple[str, ...] | None = None) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """PEFT rank_pattern: target → its own rank (a key matches targets containing it), else `default`."""
    full = random_factors(rank=max([default, *ranks.values()]), seed=seed, scale=scale, targets=targets)
    out = {}
    for t, (a, b) in full.items():
        r = next((v for k, v in ranks.items() if k in t), default)
        out[t] = (a[:r].copy(), b[:, :r].copy())
    return out


def _native_file(model, path, shape, tmp, name):
    """The native reference: the file itself (F32), or its values widened to F32 (F16/BF16, see below)."""
    ad = LoRAAdapter(model, path, name)
    if shape.dtype == "f32":
        return ad, ad.all_factors()
    values = ad.all_factors()
    ad.close()
    return LoRAAdapter(model, write_adapter(tmp / f"{name}-f32.gguf", "llama", values, shape.alpha), name), values


def _mixed_logits(model, bank, seq_tokens, entries) -> tuple[list[np.ndarray], list[np.ndarray], Context]:
    """One mixed batch through the bank (`entries`: each sequence's tokens and slot scales), every logit, on
    F32 contexts; with the base model's logits and the plain context, for native references (the caller
    closes it). A sequence without an adapter must be exactly the base."""
    bctx, nctx = _f32_ctx(model, bank.callback), _f32_ctx(model)
    try:
        bctx.handle.set_adapters([bank.adapter.handle], [1.0])
        n = sum(len(t) for t in seq_tokens)
        got = _every_logit(bctx, seq_tokens, lambda: bank.set_plan(token_scales(bank, entries), np.ones(n, bool)))
        bank.check()
        base = _every_logit(nctx, seq_tokens)
        for i, (_, scales) in enumerate(entries):
            assert scales or np.array_equal(got[i], base[i]), f"sequence {i} without an adapter is not exactly the base"
        return got, base, nctx
    except BaseException:
        nctx.close()
        raise
    finally:
        bctx.close()


def _check_against_native(model, tmp, shapes: list[Shape], *, slot_rank: int = 8, stale: bool = False) -> None:
    """Sequence i runs shape i through a 4-slot bank in one mixed batch (the rest: no adapter); each
    sequence against the native load of its shape's file. `stale`: every slot first held a full-rank
    adapter over every projection, so a write that leaves rows or targets alone is seen."""
    bank = SlotBank(model, 4, slot_rank)
    users = [LoRAAdapter(model, write_adapter(tmp / f"s{i}.gguf", "llama", s.factors, s.alpha, dtype=s.dtype),
                         f"s{i}") for i, s in enumerate(shapes)]
    if stale:
        fill = [LoRAAdapter(model, write_adapter(tmp / f"fill{k}.gguf", "llama",
                                                 random_factors(rank=slot_rank, seed=50 + k), 1.0), f"f{k}")
                for k in range(4)]
        for f in fill:
            bank.take_slot(f)
        for k, f in enumerate(fill):
            bank.return_slot(k)
            bank.forget(f)
            f.close()
    seq_tokens = [model.tokenize(p) for p in PROMPTS]
    slots = [bank.take_slot(u) for u in users]
    entries = [(len(t), [(slots[i], shapes[i].scale)] if i < len(shapes) else []) for i, t in enumerate(seq_tokens)]
    got, base, nctx = _mixed_logits(model, bank, seq_tokens, entries)
    try:
        for i, (s, u) in enumerate(zip(shapes, users)):
            native, values = _native_file(model, u.path, s, tmp, f"n{i}")
            bumped = {t: (a, (b.astype(np.float64) * (1 + 1e-7)).astype(np.float32)) for t, (a, b) in values.items()}
            perturbed = LoRAAdapter(model, write_adapter(tmp / f"p{i}.gguf", "llama", bumped, s.alpha), f"p{i}")
            nctx.handle.set_adapters([native.handle], [s.scale])
            want = _every_logit(nctx, seq_tokens)[i]
            nctx.handle.set_adapters([perturbed.handle], [s.scale])
            floor = float(np.abs(_every_logit(nctx, seq_tokens)[i] - want).max())
            nctx.handle.set_adapters([], [])
            for a in {native, perturbed} - {u}:
                a.close()
            diff = float(np.abs(got[i] - want).max())
            effect = float(np.abs(want - base[i]).max())
            assert floor > 0, f"shape {i}: the perturbation moved nothing; the comparison would see nothing"
            assert effect > 1000 * TOL_FLOORS * floor, (i, effect, floor)
            assert diff <= TOL_FLOORS * floor, f"shape {i}: bank vs native max |Δlogit| {diff:.3g}, floor {floor:.3g}"
    finally:
        nctx.close()
        for u in users:
            u.close()
        bank.close()


@pytest.fixture()
def f32_model(tiny_model):
    model = Model(tiny_model)
    yield model
    model.close()


def test_bank_alpha_not_rank_matches_native(f32_model, tmp_path):
    """alpha ≠ rank: alpha/rank 1.5 and 0.75, and alpha 0 (llama.cpp: no alpha/rank factor at all)."""
    _check_against_native(f32_model, tmp_path, [
        Shape(random_factors(rank=4, seed=11, scale=0.3), alpha=6.0, scale=0.7),
        Shape(random_factors(rank=4, seed=12, scale=0.3), alpha=3.0, scale=1.3),
        Shape(random_factors(rank=4, seed=13, scale=0.3), alpha=0.0),
    ], slot_rank=4)


def test_bank_adapters_of_different_ranks_in_one_bank(f32_model, tmp_path):
    """Ranks 2, 3, 5 and 8 side by side in slots of rank 8 that held rank-8 adapters before: the rows
    above each adapter's rank must be zeroed, not left from the previous occupant."""
    _check_against_native(f32_model, tmp_path, [
        Shape(random_factors(rank=2, seed=21, scale=0.3), alpha=4.0),
        Shape(random_factors(rank=3, seed=22, scale=0.3), alpha=4.0, scale=0.6),
        Shape(random_factors(rank=5, seed=23, scale=0.3), alpha=8.0),
        Shape(random_factors(rank=8, seed=24, scale=0.3), alpha=8.0, scale=0.8),
    ], stale=True)


def test_bank_partial_targets_match_native(f32_model, tmp_path):
    """Only q and v (and only ffn_down), written into slots that held full adapters before."""
    downs = tuple(n for n in base_shapes() if ".ffn_down." in n)
    _check_against_native(f32_model, tmp_path, [
        Shape(random_factors(rank=4, seed=31, scale=0.4, targets=QV), alpha=8.0, scale=0.9),
        Shape(random_factors(rank=2, seed=32, scale=0.4, targets=downs), alpha=2.0),
    ], stale=True)


def test_bank_per_layer_ranks_match_native(f32_model, tmp_path):
    """PEFT rank_pattern: llama.cpp scales each tensor by alpha over its own rank (b->ne[0])."""
    _check_against_native(f32_model, tmp_path, [
        Shape(_per_layer({"attn_q": 4, "blk.1.ffn_down": 2}, 8, seed=41), alpha=8.0),
        Shape(_per_layer({"blk.0.": 6, "blk.1.": 3}, 8, seed=42), alpha=12.0, scale=0.7),
        Shape(_per_layer({"attn_v": 2}, 5, seed=43, targets=QV), alpha=0.0),  # alpha 0: factor 1 everywhere
    ], stale=True)


def test_bank_f16_and_bf16_factors(f32_model, tmp_path):
    """F16 and BF16 files go into the F32 bank exactly. The reference is the native load of the same
    values widened to F32: llama.cpp's native F16/BF16 LoRA matmul first rounds the activations to
    F16/BF16, which the bank does not (docs/server.md); that difference is not the bank's error."""
    f = _per_layer({"attn_q": 2}, 4, seed=51)
    _check_against_native(f32_model, tmp_path, [
        Shape(f, alpha=6.0, scale=0.8, dtype="f16"),
        Shape(f, alpha=6.0, scale=0.8, dtype="bf16"),
        Shape(random_factors(rank=3, seed=52, scale=0.3, targets=QV), alpha=3.0, dtype="f16"),
    ])


def test_an_f16_bank_moves_results_by_f16_rounding_only(f32_model, tmp_path):
    """`bank_dtype="f16"`: the bank holds F16 factors (half the bytes), and llama.cpp then rounds the
    activations to F16 in both products. The noise floor is measured here: the same F16 file loaded
    natively (which rounds activations the same way) against its values widened to F32. The F16 bank
    must stay within a few floors of the F32 reference, while the adapter's own effect is far larger;
    sequences without an adapter are the base exactly (`_mixed_logits`)."""
    model = f32_model
    bank, wide_bank = SlotBank(model, 4, 4, dtype="f16"), SlotBank(model, 4, 4)
    shapes = [random_factors(rank=4, seed=61 + i, scale=0.4) for i in range(2)]
    users = [LoRAAdapter(model, write_adapter(tmp_path / f"h{i}.gguf", "llama", f, 4.0, dtype="f16"), f"h{i}")
             for i, f in enumerate(shapes)]
    seq_tokens = [model.tokenize(p) for p in PROMPTS]
    # a warm-tier entry (what a slot write copies) is half the bytes of the F32 bank's
    assert bank.prepare(users[0]).nbytes * 2 == wide_bank.prepare(users[0]).nbytes
    wide_bank.close()
    slots = [bank.take_slot(u) for u in users]
    entries = [(len(t), [(slots[i], 1.0)] if i < 2 else []) for i, t in enumerate(seq_tokens)]
    got, base, nctx = _mixed_logits(model, bank, seq_tokens, entries)
    try:
        for i, u in enumerate(users):
            wide = LoRAAdapter(model, write_adapter(tmp_path / f"w{i}.gguf", "llama", u.all_factors(), 4.0), f"w{i}")
            nctx.handle.set_adapters([wide.handle], [1.0])
            want = _every_logit(nctx, seq_tokens)[i]
            nctx.handle.set_adapters([u.handle], [1.0])
            floor = float(np.abs(_every_logit(nctx, seq_tokens)[i] - want).max())
            nctx.handle.set_adapters([], [])
            wide.close()
            effect = float(np.abs(want - base[i]).max())
            diff = float(np.abs(got[i] - want).max())
            assert floor > 0 and effect > 50 * floor, (i, effect, floor)
            assert diff <= 4 * floor, f"sequence {i}: F16 bank vs F32 reference {diff:.3g}, F16 rounding {floor:.3g}"
    finally:
        nctx.close()
        for u in users:
            u.close()
        bank.close()


# ------------------------------------------------------------------ numeric safety

def test_garbage_in_an_unused_slot_never_reaches_any_sequence(setup):
    """Masks select rows: whatever a slot no sequence uses holds (here finite values so large that its
    A·x overflows to Inf, as an unloaded adapter's leftovers might), every sequence is bit-identical to
    its control, base-model sequences included. A mask that multiplied by 0 would make that Inf NaN."""
    model, bank, users, tmp = setup
    slots = [bank.take_slot(u) for u in users[:2]]
    junk = next(k for k in range(K) if k not in slots)
    rows = slice(junk * R, junk * R + R)
    # written past every check (set_factors_multi refuses factors whose delta could overflow): raw bytes
    facs = bank.adapter.factor_tensors()
    for t in bank.targets:
        a, b = bank.adapter.get_factors(t)
        a[rows], b[:, rows] = 3e38, 0.5
        N.tensor_set(facs[t].a, np.ascontiguousarray(a, np.float32))
        N.tensor_set(facs[t].b, np.ascontiguousarray(b, np.float32))
    seq_tokens = [model.tokenize(p) for p in PROMPTS]
    wants = [[(slots[0], 1.0)], [(slots[1], 1.0)], [], []]
    flags = np.concatenate([[0] * (len(t) - 1) + [1] for t in seq_tokens]) != 0
    ctx, plain = _ctx(model, bank.callback), _ctx(model)
    try:
        ctx.handle.set_adapters([bank.adapter.handle], [1.0])
        scales = token_scales(bank, [(len(t), w) for t, w in zip(seq_tokens, wants)])
        mixed = _run_batch(ctx, model, seq_tokens, lambda: bank.set_plan(scales, flags))
        bank.check()
        assert all(np.isfinite(m).all() for m in mixed)
        for i in range(2):
            pad = _padded(bank, users[i], slots[i], tmp / f"pad{i}.gguf")
            plain.handle.set_adapters([pad.handle], [1.0])
            assert np.array_equal(mixed[i], _run_batch(plain, model, seq_tokens)[i]), f"seq {i}"
            plain.handle.set_adapters([], [])
            pad.close()
        base = _run_batch(plain, model, seq_tokens)
        assert np.array_equal(mixed[2], base[2]) and np.array_equal(mixed[3], base[3])
    finally:
        ctx.close()
        plain.close()


def test_factors_whose_delta_could_overflow_are_refused_at_load(f32_model, tmp_path):
    """The bound of docs/server.md: max|A|·in, |alpha|·max|B| and their product each at most 2^64."""
    from loramux.errors import AdapterError

    t = "blk.0.attn_q.weight"
    n_in = base_shapes()[t][1]

    def load(name, a_max, b_max, alpha=4.0):
        f = random_factors(rank=4, seed=61, scale=0.3)
        a, b = f[t]
        f[t] = (a / np.abs(a).max() * a_max, b / np.abs(b).max() * b_max)
        return LoRAAdapter(f32_model, write_adapter(tmp_path / f"{name}.gguf", "llama", f, alpha), name)

    edge = 2.0 ** 64 / n_in  # max|A| at which max|A|·in is exactly 2^64
    ok = load("edge", edge / 2, 2.0 ** -4 / 4)  # g_A = 2^63, g_B = 2^-4: within every bound
    ok.close()
    for name, a_max, b_max in [("issue", 3e38, 3e38), ("a-stage", edge * 2, 2.0 ** -8),
                               ("b-stage", 1e-3, 2.0 ** 63), ("product", 2.0 ** 40 / n_in, 2.0 ** 24)]:
        with pytest.raises(AdapterError, match="overflow F32") as e:
            load(name, a_max, b_max)
        assert t in str(e.value), name
    with pytest.raises(AdapterError, match="alpha"):
        load("nan-alpha", 0.3, 0.3, alpha=float("nan"))


# ------------------------------------------------------------------ the reported bug, through the engine

def _bumped_file(path, tmp, name):
    """The same adapter with every B scaled by (1 + 1e-7): the noise-floor control."""
    from loramux.gguf_io import read_adapter_factors, validate_adapter

    info = validate_adapter(path)
    f = {t: (a, (b.astype(np.float64) * (1 + 1e-7)).astype(np.float32)) for t, (a, b) in read_adapter_factors(path).items()}
    return write_adapter(tmp / f"{name}.gguf", "llama", f, info.alpha)


def _assert_native_choices(eng, prompt, comp, loras, bumped):
    """Every generated token is llama.cpp's native choice (teacher-forced, the adapter loaded natively,
    one sequence alone) up to the noise floor: within TOL_FLOORS floors of the native argmax logit."""
    assert comp.tokens, "nothing generated"
    seq = prompt + comp.tokens[:-1]
    want = eng.logits(seq, loras=loras)[len(prompt) - 1:]
    floor = float(np.abs(eng.logits(seq, loras=bumped)[len(prompt) - 1:] - want).max())
    assert floor > 0
    picked = want[np.arange(len(comp.tokens)), comp.tokens]
    worst = float((want.max(axis=1) - picked).max())
    assert worst <= TOL_FLOORS * floor, f"{loras}: a token {worst:.3g} below the native argmax (floor {floor:.3g})"


def _result(stream, timeout_s=120.0):
    """The request's completion, or its error raised; a request the engine lost fails, never hangs."""
    import queue

    while True:
        try:
            kind, value = stream.request.events.get(timeout=timeout_s)
        except queue.Empty:
            pytest.fail(f"request {stream.request.id} got no result in {timeout_s:.0f} s")
        if kind == "error":
            raise value
        if kind == "done":
            return value


def _wait_generating(streams, deadline_s=60.0):
    import time

    end = time.monotonic() + deadline_s
    while any(len(s.request.generated) < 2 for s in streams):
        assert time.monotonic() < end, "requests did not start generating"
        time.sleep(0.0005)  # short: a fast host decodes dozens of the tiny model's tokens in 5 ms


@pytest.fixture()
def rank_pattern_engine(tiny_model, tmp_path):
    """Serving engine (4 slots of rank 8, F32 KV) with an ordinary adapter and a PEFT rank_pattern one
    (rank 4 on attn_q, 8 elsewhere), plus their noise-floor twins."""
    import loramux as lm

    files = {"plain": write_adapter(tmp_path / "plain.gguf", "llama", random_factors(rank=8, seed=71, scale=0.3), 8.0),
             "mixed": write_adapter(tmp_path / "mixed.gguf", "llama", _per_layer({"attn_q": 4}, 8, seed=72), 8.0)}
    files.update({f"{n}~": _bumped_file(p, tmp_path, f"{n}-bumped") for n, p in list(files.items())})
    eng = lm.Engine.load(tiny_model, n_ctx=128, n_parallel=4, n_batch=128, n_threads=2, slots=4, slot_rank=8,
                         kv_type="f32", loras=[lm.LoraSpec(str(p), 0.0, name=n) for n, p in files.items()])
    yield eng
    eng.close()


def test_mixed_rank_adapter_joins_running_requests(rank_pattern_engine):
    """The reported bug: two requests run on an ordinary adapter when a third asks for the rank_pattern
    one. All three return llama.cpp's native result; before, the slot write raised and failed all."""
    eng = rank_pattern_engine
    toks = [eng.tokenize(p) for p in PROMPTS[:3]]
    running = [eng.stream(toks[i], loras={"plain": 1.0}, max_tokens=40, ignore_eos=True) for i in range(2)]
    _wait_generating(running)
    third = eng.stream(toks[2], loras={"mixed": 1.0}, max_tokens=16, ignore_eos=True)
    assert all(len(s.request.generated) < 40 for s in running)  # still running when it arrives
    comps = [_result(s) for s in running + [third]]
    assert [len(c.tokens) for c in comps] == [40, 40, 16]
    assert third.request.phases[-1].banked and running[0].request.phases[-1].banked  # rank_pattern: banked
    for t, c, name in zip(toks, comps, ["plain", "plain", "mixed"]):
        _assert_native_choices(eng, t, c, {name: 1.0}, {f"{name}~": 1.0})


def test_failed_slot_write_fails_only_its_request_and_leaves_the_slot_empty(rank_pattern_engine, monkeypatch):
    """A slot write that fails half-way (the backend raising on a later tensor) fails that request alone
    with an error naming its adapter; the slot is left empty and free, and the next write takes it."""
    from loramux.engine.slot_memory import SlotMemory
    from loramux.errors import BackendError

    eng = rank_pattern_engine
    toks = [eng.tokenize(p) for p in PROMPTS[:3]]
    running = eng.stream(toks[0], loras={"plain": 1.0}, max_tokens=40, ignore_eos=True)
    _wait_generating([running])
    real, calls = SlotMemory.put, []

    def flaky(self, k, t, block):  # the copy of one target into the slot (host memory or a device)
        if block is not None:
            calls.append(1)
            if len(calls) == 3:
                raise RuntimeError("device lost")
        return real(self, k, t, block)
    monkeypatch.setattr(SlotMemory, "put", flaky)
    failing = eng.stream(toks[1], loras={"mixed": 1.0}, max_tokens=8, ignore_eos=True)
    with pytest.raises(BackendError, match="'mixed'.*device lost"):
        _result(failing)
    states = eng.call(lambda: [(s.adapter.name if s.adapter else None, s.refs) for s in eng.bank.slots])
    names = [n for n, _ in states]  # plain's slot holds 1 user, or 0 if its request already ended (fast host)
    assert names.count("plain") == 1 and "mixed" not in names and states.count((None, 0)) == 3
    monkeypatch.setattr(SlotMemory, "put", real)
    again_stream = eng.stream(toks[2], loras={"mixed": 1.0}, max_tokens=8, ignore_eos=True)
    again = _result(again_stream)
    comp = _result(running)
    assert len(comp.tokens) == 40 and again_stream.request.phases[-1].banked and eng.bank.writes >= 2
    _assert_native_choices(eng, toks[0], comp, {"plain": 1.0}, {"plain~": 1.0})
    _assert_native_choices(eng, toks[2], again, {"mixed": 1.0}, {"mixed~": 1.0})


def test_adapter_listing_says_whether_it_goes_through_the_bank(tiny_model, tmp_path):
    """An adapter that cannot go into a slot is served natively and /v1/models says why."""
    import httpx

    import loramux as lm
    from loramux.server import ServerSettings, create_app, serve_in_thread

    small = write_adapter(tmp_path / "small.gguf", "llama", _per_layer({"attn_q": 2}, 4, seed=81), 4.0)
    big = write_adapter(tmp_path / "big.gguf", "llama", _per_layer({"attn_q": 2}, 8, seed=82), 8.0)
    eng = lm.Engine.load(tiny_model, n_ctx=128, n_parallel=2, n_threads=1, slots=2, slot_rank=4,
                         loras=[lm.LoraSpec(str(small), 0.0, "small"), lm.LoraSpec(str(big), 0.0, "big")])
    adm = eng.call(lambda: eng.bank.take_slots([eng.registry.adapter_set({"big": 1.0})]))
    assert adm is not None and not adm.banked and adm.reason == "big: rank 8 > slot rank 4" and adm.slots == ()
    with serve_in_thread(create_app(eng, ServerSettings(), own_engine=True)) as srv:
        listed = {m["id"]: m for m in httpx.get(srv.url + "/v1/models", timeout=30).json()["data"]}
    assert (listed["small"]["banked"], listed["small"]["bank_reason"]) == (True, None)
    assert (listed["big"]["banked"], listed["big"]["bank_reason"]) == (False, "rank 8 > slot rank 4")


def test_device_mask_path_is_bit_identical_and_moves_only_the_rows_it_changes(setup):
    """The transfer path (for node outputs off the host: GPU, RPC), forced on the CPU: the same bits as
    masking in place, and only rows the mask changes cross the boundary, one run per call."""
    model, bank, users, tmp = setup
    slots = [bank.take_slot(u) for u in users]
    seq_tokens = [model.tokenize(p) for p in PROMPTS]
    # per sequence: every slot at exactly 1 (its rows are left alone), none (written as zeros, never
    # read), one slot at 0.5 and two slots at 1 (read, masked, written back)
    wants = [[(k, 1.0) for k in range(K)], [], [(slots[1], 0.5)], [(slots[0], 1.0), (slots[2], 1.0)]]
    flags = np.concatenate([[0] * (len(t) - 1) + [1] for t in seq_tokens]) != 0
    scales = token_scales(bank, [(len(t), w) for t, w in zip(seq_tokens, wants)])
    seen: list[int] = []

    def callback(t, ask):
        if not ask:
            seen.append(N.node_ne1(t))
        return bank.callback(t, ask)

    ctx = _ctx(model, callback)
    ctx.handle.set_adapters([bank.adapter.handle], [1.0])
    runs, moved, nodes = {}, {}, {}
    for access in ("auto", "device"):
        bank.node_access = access
        before = dict(bank.transfers)
        seen.clear()
        runs[access] = _run_batch(ctx, model, seq_tokens, lambda: bank.set_plan(scales, flags))
        bank.check()
        moved[access] = {k: bank.transfers[k] - before[k] for k in before}
        nodes[access] = list(seen)
    ctx.close()
    assert moved["auto"] == {"gets": 0, "sets": 0, "rows_read": 0, "rows_written": 0}  # host: in place
    assert nodes["auto"] == nodes["device"]
    moved, seen = moved["device"], nodes["device"]
    for a, b in zip(runs["auto"], runs["device"]):
        assert np.array_equal(a, b)
    assert not np.array_equal(runs["device"][0], runs["device"][1])  # the masks did something
    n_full = sum(len(t) for t in seq_tokens)
    lens = [len(t) for t in seq_tokens]
    # rows written, rows read, runs (calls to set): a zeros run (seq 1) and one read run (seqs 2 and 3)
    per_node = {n_full: (n_full - lens[0], n_full - lens[0] - lens[1], 2),
                len(seq_tokens): (3, 2, 2)}  # output rows: one per sequence
    assert set(seen) <= set(per_node)
    assert moved["rows_written"] == sum(per_node[n][0] for n in seen)
    assert moved["rows_read"] == sum(per_node[n][1] for n in seen)
    assert moved["sets"] == sum(per_node[n][2] for n in seen)
    assert moved["gets"] == len(seen)  # only the read run is fetched


def test_engine_with_the_device_mask_path_serves_the_same_tokens(tiny_model, tmp_path):
    import loramux as lm

    paths = []
    for i, rank in enumerate([2, 4, 3]):
        f = random_factors(rank=rank, seed=200 + i, scale=0.5)
        paths.append(str(write_adapter(tmp_path / f"u{i}.gguf", "llama", f, alpha=float(rank))))
    prompts = ["the cat sat on the mat", "a dog ran in the big red", "hello world it was", "we and you and she",
               "she ran and the dog"]
    outs, moved = {}, {}
    for access in ("auto", "device"):
        with lm.Engine.load(tiny_model, n_ctx=128, n_parallel=8, n_batch=128, n_threads=2, slots=4, slot_rank=4,
                            bank_node_access=access, loras=[lm.LoraSpec(p, 0.0) for p in paths]) as eng:
            toks = [eng.tokenize(p) for p in prompts]
            outs[access] = [c.tokens for c in eng.generate_many(toks, loras=SETS, max_tokens=10, ignore_eos=True)]
            moved[access] = eng.bank.transfers["rows_written"]
    assert outs["auto"] == outs["device"]
    assert moved["auto"] == 0 and moved["device"] > 0


def _hot_adapter(model, path, target="blk.0.attn_v.weight", value=300.0):
    """An adapter whose delta on `target` is ~value²·in: finite in F32, far past F16's 65504."""
    out_dim, in_dim = model.tensor_shapes[target]
    p = write_adapter(path, "llama", {target: (np.full((2, in_dim), value, np.float32),
                                               np.full((out_dim, 2), value, np.float32))}, alpha=2.0)
    return LoRAAdapter(model, p, "hot")


@pytest.mark.parametrize("flash_attn", [False, True])  # V cache transposed / not: two layouts of the KV writes
@pytest.mark.parametrize("target", ["blk.0.attn_v.weight", "blk.1.attn_k.weight"])
def test_an_adapter_that_overflows_the_f16_kv_cache_leaves_the_other_sequences_of_its_decode_alone(
        setup, tmp_path, target, flash_attn):
    model, bank, users, tmp = setup
    hot = _hot_adapter(model, tmp_path / "hot.gguf", target)
    guard = KvGuard(model, bank.callback, "f16")
    try:
        assert guard.risky([AdapterSet(((hot, 1.0),))]) and not guard.risky([AdapterSet(((users[0], 1.0),))])
        k_hot, k_user = bank.take_slot(hot), bank.take_slot(users[0])
        seq_tokens = [model.tokenize(PROMPTS[0]), model.tokenize(PROMPTS[1]), model.tokenize(PROMPTS[2])]
        flags = np.concatenate([[0] * (len(x) - 1) + [1] for x in seq_tokens]) != 0
        ctx = Context(model, ContextOptions(n_ctx=512, n_batch=64, n_ubatch=64, n_seq_max=4, n_threads=2,
                                            kv_unified=True, flash_attn=flash_attn), callback=bank.callback)
        ctx.handle.set_adapters([bank.adapter.handle], [1.0])
        n = [len(x) for x in seq_tokens]

        def run(hot_scale, guarded):
            sc = token_scales(bank, [(n[0], [(k_hot, hot_scale)] if hot_scale else []), (n[1], [(k_user, 1.0)]),
                                     (n[2], [])])
            if guarded:
                guard.arm(sum(n))
            try:
                out = _run_batch(ctx, model, seq_tokens, lambda: bank.set_plan(sc, flags))
            finally:
                bad = guard.disarm() if guarded else None
            bank.check()
            return out, bad

        clean, _ = run(0.0, False)
        poisoned, _ = run(1.0, False)  # without the guard the others of the decode break as well (the CPU's
        if not flash_attn:  # one-chunk flash-attention kernel skips masked cells; its tiled one does not)
            assert not np.isfinite(poisoned[1]).all() and not np.isfinite(poisoned[2]).all()
        mixed, bad = run(1.0, True)
        ctx.close()
        assert not guard.problems
        assert bad.tolist() == list(range(n[0]))  # every token of the hot sequence, and only those
        assert np.array_equal(mixed[1], clean[1]) and np.array_equal(mixed[2], clean[2])
    finally:
        hot.close()


def test_the_kv_guard_bound_follows_the_adapter_scale_and_cache_type(setup, tmp_path):
    model, bank, users, tmp = setup
    hot = _hot_adapter(model, tmp_path / "hot.gguf", value=0.3)  # delta ~ 0.09·in per unit input
    try:
        g_kv, g_other = KvGuard(model, None, "f16").gains(hot)
        assert g_kv > 0 and g_other == 0
        f16, f32 = KvGuard(model, None, "f16"), KvGuard(model, None, "f32")
        assert math.isfinite(f16.x_bound) and f16.x_bound > 0  # the tiny model's attn_norm weights are F32
        edge = f16.risk_limit / (g_kv * f16.x_bound)  # the scale at which the bound reaches the limit
        assert not f16.risky([AdapterSet(((hot, edge * 0.99),))])
        assert f16.risky([AdapterSet(((hot, edge * 1.01),))]) and f16.risky([AdapterSet(((hot, -edge * 1.01),))])
        assert not f32.risky([AdapterSet(((hot, edge * 1.01),))])  # an F32 cache has room for it
        assert not f16.risky([AdapterSet(((users[0], 1.0), (users[1], 1.0)))])
    finally:
        hot.close()


def test_the_kv_guard_maps_zeroed_tokens_to_their_batch_entries(setup):
    model, bank, users, tmp = setup
    guard = KvGuard(model, None, "f16")
    for bad, want in [([], set()), ([0], {0}), ([2], {0}), ([3], {1}), ([4, 5], {2}), ([2, 3, 5], {0, 1, 2})]:
        guard.last_bad = np.array(bad, np.int64)
        assert guard.hit_entries([3, 1, 2]) == want, bad


# -- decodes without the eval callback ---------------------------------------------------------------

def _fill(ctx, seq_tokens):
    ctx.clear()
    ctx.batch.clear()
    for s, toks in enumerate(seq_tokens):
        ctx.batch.add(toks, 0, s, [False] * (len(toks) - 1) + [True])


def _rows(ctx):
    return [ctx.handle.logits_row(i) for i in np.nonzero(ctx.batch.logits[: ctx.batch.n])[0]]


def test_a_decode_without_the_eval_callback_asks_about_no_node_and_gives_the_same_logits(setup):
    """A native decode on a bank context takes the callback off llama.cpp's scheduler and puts it back."""
    model, bank, users, tmp = setup
    asks = [0]

    def count(t, ask):
        asks[0] += bool(ask)
        return False  # never stop: the graph runs as without a callback
    seq_tokens = [model.tokenize(p) for p in PROMPTS]
    native = LoRAAdapter(model, users[0].path, "native")
    for cb in (count, bank.callback):
        ctx = _ctx(model, cb)
        ctx.handle.set_adapters([native.handle], [1.0])
        got = []
        for on in (True, False, True, False, False):  # the same shape: llama.cpp reuses the graph
            _fill(ctx, seq_tokens)
            before = asks[0]
            ctx.handle.decode(ctx.batch, eval_callback=on)
            got.append((on, asks[0] - before, _rows(ctx)))
        if cb is count:
            n_on = got[0][1]
            assert n_on > 50 and [n for _, n, _ in got] == [n_on, 0, n_on, 0, 0]
        for _, _, rows in got[1:]:
            assert all(np.array_equal(a, b) for a, b in zip(rows, got[0][2]))  # bit for bit
        ctx.handle.set_adapters([], [])
        ctx.close()
    native.close()


def test_a_bank_decode_after_one_without_the_callback_is_masked_again(setup):
    """The bank's decode gives the callback back even when llama.cpp reuses the graph that ran without it."""
    model, bank, users, tmp = setup
    slots = [bank.take_slot(u) for u in users]
    seq_tokens = [model.tokenize(p) for p in PROMPTS]
    plain = _ctx(model)
    controls = []
    for i, u in enumerate(users):
        pad = _padded(bank, u, slots[i], tmp / f"pad{i}.gguf")
        plain.handle.set_adapters([pad.handle], [1.0])
        controls.append(_run_batch(plain, model, seq_tokens)[i])
        plain.handle.set_adapters([], [])
        pad.close()
    controls.append(_run_batch(plain, model, seq_tokens)[3])  # seq 3: no adapter
    plain.close()
    ctx = _ctx(model, bank.callback)
    ctx.handle.set_adapters([bank.adapter.handle], [1.0])
    entries = [(len(t), [(slots[i], 1.0)] if i < 3 else []) for i, t in enumerate(seq_tokens)]
    for step in range(3):
        _fill(ctx, seq_tokens)
        bank.decode(ctx, entries)
        assert all(np.array_equal(g, c) for g, c in zip(_rows(ctx), controls)), step
        # the same batch without the callback: nothing masks the bank, so seq 3 gets every slot's delta
        _fill(ctx, seq_tokens)
        ctx.handle.decode(ctx.batch, eval_callback=False)
        assert not np.array_equal(_rows(ctx)[3], controls[3])
    assert bank.unplanned == 0
    ctx.handle.set_adapters([], [])
    ctx.close()


def test_a_slot_write_never_gives_the_gil_away(gemma):
    """A slot write beside a busy Python thread (a load's parse, the event loop) keeps the GIL: every copy
    that gave it away waited that thread's switch interval to take it back (a write of the default model's
    252 copies took 20-70 ms in a server loading cold adapters instead of 2.5 ms). Counted, not timed:
    with a switch interval of 0.5 s, the busy thread only runs during the write if the write lets it."""
    import sys
    import threading
    import time

    bank = SlotBank(gemma.model, 2, 8)
    rng = np.random.default_rng(5)
    facs = bank.memory.facs
    blocks = {t: (rng.standard_normal((8, facs[t].a_shape[1])).astype(np.float32),
                  rng.standard_normal((facs[t].b_shape[0], 8)).astype(np.float32)) for t in bank.targets}
    assert max(b.shape[0] for _, b in blocks.values()) > 500  # B's column blocks: more rows than one copy keeps
    ran = [0]
    stop = threading.Event()

    def busy() -> None:
        while not stop.is_set():
            ran[0] += 1

    interval = sys.getswitchinterval()
    sys.setswitchinterval(0.5)
    th = threading.Thread(target=busy)
    th.start()
    try:
        while ran[0] == 0:
            time.sleep(0.001)
        before = ran[0]
        for t, block in blocks.items():
            bank.memory.put(1, t, block)
        during = ran[0] - before
    finally:
        stop.set()
        th.join()
        sys.setswitchinterval(interval)
    try:
        assert during == 0, "a slot write gave the GIL away"
        assert bank.memory.ranks[1] == {t: 8 for t in bank.targets}
    finally:
        bank.close()


def test_a_slot_no_token_uses_changes_no_bit_of_the_others_mid_write(f32_model, tmp_path):
    """Why a slot may be written beside running decodes (engine/slot_copier.py): with slot 1 planned for no
    token, the other sequences' logits through the bank are the same bits whatever slot 1 holds: empty,
    an adapter's targets half written (a copy caught midway), all of them, or A all NaN and B at 1e30
    (each token's rows of A·x are selected to exactly 0, and B's finite values times 0 add ±0)."""
    model = f32_model
    bank = SlotBank(model, 2, 4)
    users = [LoRAAdapter(model, write_adapter(tmp_path / f"{n}.gguf", "llama", random_factors(rank=4, seed=s), 4.0),
                         n) for n, s in (("p", 31), ("q", 32))]
    try:
        k = bank.take_slot(users[0])
        assert k == 0
        blocks = bank.prepare(users[1]).blocks
        seq_tokens = [model.tokenize(p) for p in PROMPTS[:3]]
        entries = [(len(seq_tokens[0]), [(k, 1.0)]), (len(seq_tokens[1]), [(k, 0.5)]), (len(seq_tokens[2]), [])]

        def logits() -> list[np.ndarray]:
            got, base[:], nctx = _mixed_logits(model, bank, seq_tokens, entries)
            nctx.close()
            return got

        base: list[np.ndarray] = []
        ref = logits()
        targets = sorted(blocks)
        seen = []
        for part in (targets[: len(targets) // 2], targets[len(targets) // 2:]):
            for t in part:
                bank.memory.put(1, t, blocks[t])
            seen.append(logits())
        for t in targets:
            a, b = blocks[t]
            bank.memory.put(1, t, (np.full_like(a, np.nan), np.full_like(b, 1e30)))
        seen.append(logits())
        for got in seen:
            assert all(np.array_equal(g, r) for g, r in zip(got, ref))
        assert not np.array_equal(ref[0], base[0])  # slot 0's adapter is applied: the comparison can fail
    finally:
        bank.close()
        for u in users:
            u.close()
