"""Control vectors on real llama.cpp: file format and layer convention, settings, engine and CLI, training."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import gguf
import numpy as np
import pytest
import tinymodel
from conftest import PROMPT, max_diff

import loramux as lm
from loramux.cli import main as cli_main
from loramux.engine.control import (
    ControlSetting,
    ControlVector,
    direction_from_pairs,
    parse_layers,
    read_examples,
    residual_stream,
)
from loramux.errors import ControlVectorError, ParameterError
from loramux.gguf_io import write_control_vector

E = tinymodel.E
REPO = Path(__file__).resolve().parent.parent


def rand(seed: int, scale: float = 1.0, n: int = E) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(n) * scale).astype(np.float32)


@pytest.fixture(scope="module")
def tiny4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with 4 blocks, so a one-layer vector has layers before and after it."""
    path = tmp_path_factory.mktemp("tiny4") / "tiny4.gguf"
    old = tinymodel.N_LAYER
    tinymodel.N_LAYER = 4  # write_tiny_model and base_shapes read the module constant
    try:
        tinymodel.write_tiny_model(path)
    finally:
        tinymodel.N_LAYER = old
    return path


@pytest.fixture()
def eng4(tiny4: Path):
    eng = lm.Engine.load(tiny4, n_ctx=256, n_threads=2)
    yield eng
    eng.close()


def llama_cpp_loader(path: Path, strength: float, n_embd: int) -> np.ndarray:
    """Emulates common_control_vector_load_one: direction.N goes to row N-1 (via gguf's own reader)."""
    r = gguf.GGUFReader(str(path))
    data = np.zeros(0, np.float32)
    for t in r.tensors:
        head, _, idx = t.name.partition(".")
        assert head == "direction" and int(idx) >= 1 and t.tensor_type == gguf.GGMLQuantizationType.F32
        n = int(idx)
        if data.size < n_embd * n:
            data = np.concatenate([data, np.zeros(n_embd * n - data.size, np.float32)])
        data[n_embd * (n - 1):n_embd * n] += np.asarray(t.data, np.float32).reshape(-1) * np.float32(strength)
    return data


# ------------------------------------------------------------------------------------------- invariants
def test_zero_and_cleared_vector_give_base_logits_exactly(engine, tmp_path):
    base = engine.logits(PROMPT)
    ControlVector({1: np.zeros(E, np.float32), 2: np.zeros(E, np.float32)}, "llama").save(tmp_path / "z.gguf")
    engine.set_control_vector(tmp_path / "z.gguf")
    assert engine.control is not None and engine.control.is_zero
    assert max_diff(engine.logits(PROMPT), base) == 0.0
    engine.set_control_vector(ControlVector({1: rand(1)}), strength=0.0)
    assert max_diff(engine.logits(PROMPT), base) == 0.0
    engine.set_control_vector(ControlVector({1: rand(1)}), strength=2.0)
    steered = engine.logits(PROMPT)
    assert max_diff(steered, base) > 1e-2
    engine.clear_control_vector()
    assert engine.control is None
    assert max_diff(engine.logits(PROMPT), base) == 0.0


@pytest.mark.parametrize("layer", [1, 2, 3])
def test_direction_n_shifts_exactly_residual_after_block_n(eng4, tmp_path, layer):
    """The convention, measured: direction.N is added to l_out-N (0-based block N), nothing earlier."""
    v = rand(layer, 2.0)
    ControlVector({layer: v}, "llama").save(tmp_path / "one.gguf")
    setting = ControlSetting.build(eng4.model, [(ControlVector.load(tmp_path / "one.gguf"), 1.0)])
    base = residual_stream(eng4, PROMPT)
    got = residual_stream(eng4, PROMPT, control=setting)
    assert sorted(got) == [0, 1, 2, 3]
    for k in range(layer):
        assert max_diff(got[k], base[k]) == 0.0, f"l_out-{k} moved"
    assert max_diff(got[layer] - base[layer], np.broadcast_to(v, base[layer].shape)) < 1e-5
    for k in range(layer + 1, 4):
        assert max_diff(got[k], base[k]) > 1e-3  # the shift propagates through later blocks


def test_direction_n_layer_is_never_applied(eng4):
    """Like llama.cpp: block 0 gets no vector, so direction.<n_layer> has nowhere to go."""
    base = eng4.logits(PROMPT)
    setting = ControlSetting.build(eng4.model, [(ControlVector({4: rand(4, 5.0)}), 1.0)])
    assert max_diff(eng4.logits(PROMPT, control=setting), base) == 0.0


def test_file_round_trip_matches_llama_cpp_loader_indexing(tmp_path):
    dirs = {1: rand(1), 3: rand(3), 2: rand(2)}
    out = ControlVector(dirs, "llama").save(tmp_path / "v.gguf")
    r = gguf.GGUFReader(str(out))
    assert bytes(r.fields["general.architecture"].parts[-1]).decode() == "controlvector"
    assert bytes(r.fields["controlvector.model_hint"].parts[-1]).decode() == "llama"
    assert int(r.fields["controlvector.layer_count"].parts[-1][0]) == 3
    assert r.fields["controlvector.layer_count"].types == [gguf.GGUFValueType.INT32]
    loaded = ControlVector.load(out)
    assert loaded.layers == [1, 2, 3] and loaded.model_hint == "llama"
    for k, v in dirs.items():
        assert np.array_equal(loaded.directions[k], v)

    class M:
        n_layer, n_embd, architecture = 4, E, "llama"
    setting = ControlSetting.build(M, [(loaded, 0.75)])
    emulated = llama_cpp_loader(out, 0.75, E)
    assert np.array_equal(setting.data.ravel()[:emulated.size], emulated)
    assert not setting.data.ravel()[emulated.size:].any()


def test_reads_a_file_written_like_cvector_generator(tmp_path):
    """A file made the way llama.cpp's tool writes it (its own keys, direction.1..n_layer-1)."""
    path = tmp_path / "gen.gguf"
    w = gguf.GGUFWriter(str(path), "controlvector")
    w.add_string("controlvector.model_hint", "llama")
    w.add_int32("controlvector.layer_count", 3)
    for il in range(3):
        w.add_tensor(f"direction.{il + 1}", rand(10 + il))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    cv = ControlVector.load(path)
    assert cv.layers == [1, 2, 3] and np.array_equal(cv.directions[2], rand(11))


def test_layer_range_restricts_application(eng4):
    cv = ControlVector({1: rand(1), 2: rand(2), 3: rand(3)})
    ranged = ControlSetting.build(eng4.model, [(cv, 1.0)], (2, 2))
    only2 = ControlSetting.build(eng4.model, [(ControlVector({2: cv.directions[2]}), 1.0)])
    full = ControlSetting.build(eng4.model, [(cv, 1.0)])
    base = residual_stream(eng4, PROMPT)
    got = residual_stream(eng4, PROMPT, control=ranged)
    assert max_diff(got[1], base[1]) == 0.0
    assert max_diff(got[2] - base[2], np.broadcast_to(cv.directions[2], base[2].shape)) < 1e-5
    assert max_diff(eng4.logits(PROMPT, control=ranged), eng4.logits(PROMPT, control=only2)) == 0.0
    assert max_diff(eng4.logits(PROMPT, control=ranged), eng4.logits(PROMPT, control=full)) > 1e-3
    assert ranged.key != full.key and ranged.key != only2.key  # same logits, different data: own KV


def test_several_vectors_summed_equal_one_summed_file(engine, tmp_path, capsys):
    a, b = ControlVector({1: rand(1), 2: rand(2)}), ControlVector({2: rand(3)})
    a.save(tmp_path / "a.gguf")
    b.save(tmp_path / "b.gguf")
    summed = ControlVector({1: np.float32(0.5) * rand(1),
                            2: np.float32(0.5) * rand(2) + np.float32(-1.5) * rand(3)})
    summed.save(tmp_path / "sum.gguf")
    two = ControlSetting.build(engine.model, [(ControlVector.load(tmp_path / "a.gguf"), 0.5),
                                              (ControlVector.load(tmp_path / "b.gguf"), -1.5)])
    one = ControlSetting.build(engine.model, [(ControlVector.load(tmp_path / "sum.gguf"), 1.0)])
    assert np.abs(two.data - one.data).max() < 1e-6
    two_logits = engine.logits(PROMPT, control=two)
    assert max_diff(two_logits, engine.logits(PROMPT, control=one)) < 1e-4
    assert max_diff(two_logits, engine.logits(PROMPT, control=None)) > 1e-3
    # the same through from_any (a list of pairs) and the CLI's --control-vector FILE:STRENGTH
    listed = ControlSetting.from_any(engine, [(tmp_path / "a.gguf", 0.5), (tmp_path / "b.gguf", -1.5)])
    assert listed == two
    doubled = ControlSetting.build(engine.model, [(ControlVector.load(tmp_path / "a.gguf"), np.float32(1.0)),
                                                  (ControlVector.load(tmp_path / "b.gguf"), -3.0)])
    assert ControlSetting.from_any(engine, two, 2.0) == doubled  # ×2 is exact in float32
    assert ControlSetting.from_any(engine, two, 1.0, (2, 2)).layers == (2, 2)
    from loramux.cli import build_parser
    from loramux.cli.common import apply_control_args
    args = build_parser().parse_args(["run", "-p", "x", "--control-vector", f"{tmp_path / 'a.gguf'}:0.5",
                                      "--control-vector", f"{tmp_path / 'b.gguf'}:-1.5"])
    apply_control_args(engine, args)
    assert engine.control == two
    assert max_diff(engine.logits(PROMPT), two_logits) == 0.0


def test_per_request_control_vs_default(engine):
    strong = ControlSetting.build(engine.model, [(ControlVector({1: rand(7, 6.0), 2: rand(8, 6.0)}), 1.0)])
    kw = dict(max_tokens=12, temperature=0.0, ignore_eos=True)
    base = engine.generate(PROMPT, **kw).tokens
    steered = engine.generate(PROMPT, control=strong, **kw).tokens
    assert steered != base
    engine.set_control_vector(ControlVector({1: rand(7, 6.0), 2: rand(8, 6.0)}))
    assert engine.control == strong
    assert engine.generate(PROMPT, **kw).tokens == steered  # the default applies
    req = engine.submit(PROMPT, control=None, **kw)
    kind, value = req.events.get(timeout=60)
    while kind == "text":
        kind, value = req.events.get(timeout=60)
    assert kind == "done" and value.tokens == base  # None overrides the default for this request
    assert engine.generate(PROMPT, **kw).tokens == steered  # and leaves the default in place
    engine.clear_control_vector()
    assert engine.generate(PROMPT, **kw).tokens == base


def test_concurrent_requests_keep_their_own_settings(tiny_model):
    with lm.Engine.load(tiny_model, n_ctx=256, n_parallel=3, n_threads=2) as eng:
        s1 = ControlSetting.build(eng.model, [(ControlVector({1: rand(7, 6.0)}), 1.0)])
        s2 = ControlSetting.build(eng.model, [(ControlVector({1: rand(7, 6.0)}), -1.0)])
        kw = dict(max_tokens=10, temperature=0.0, ignore_eos=True)
        solo = [eng.generate(PROMPT, control=c, **kw).tokens for c in (None, s1, s2)]
        assert len({tuple(t) for t in solo}) == 3
        reqs = [eng.submit(PROMPT, control=c, **kw) for c in (None, s1, s2)]
        outs = []
        for r in reqs:
            kind, value = r.events.get(timeout=60)
            while kind == "text":
                kind, value = r.events.get(timeout=60)
            outs.append(value.tokens)
        assert outs == solo


# ------------------------------------------------------------------------------------------- bad input
def test_bad_vectors_raise_one_error_listing_every_problem(engine, tmp_path):
    wrong = ControlVector({1: rand(1, n=32), 5: rand(2, n=32)}, source="wrong.gguf")
    with pytest.raises(ControlVectorError) as ei:
        ControlSetting.build(engine.model, [(wrong, 1.0)], (0, 3))
    text = str(ei.value)
    assert "wrong.gguf" in text and "n_embd is 64" in text and "[5]" in text and "0-3" in text
    assert len(ei.value.problems) == 3
    nan = rand(1)
    nan[3] = np.nan
    with pytest.raises(ControlVectorError, match="non-finite"):
        ControlSetting.build(engine.model, [(ControlVector({1: nan}), 1.0)])
    with pytest.raises(ControlVectorError, match="strength"):
        ControlSetting.build(engine.model, [(ControlVector({1: rand(1)}), float("inf"))])
    with pytest.raises(ControlVectorError, match="overflows"):
        ControlSetting.build(engine.model, [(ControlVector({1: rand(1)}), 3e38)])
    for rng in [(2, 1), (1, 3), (0, 1)]:
        with pytest.raises(ControlVectorError, match="outside 1-2"):
            ControlSetting.build(engine.model, [(ControlVector({1: rand(1)}), 1.0)], rng)
    with pytest.raises(ControlVectorError, match="refusing"):
        ControlVector({0: rand(1)}).save(tmp_path / "zero_layer.gguf")
    assert engine.control is None  # nothing was set along the way


def test_bad_files_raise_typed_errors(engine, tiny_model, tiny_dir, tmp_path):
    cases = {"model": tiny_model, "adapter": tiny_dir / "a.gguf", "missing": tmp_path / "nope.gguf"}
    (tmp_path / "text.gguf").write_text("hello")
    cases["text"] = tmp_path / "text.gguf"
    write_control_vector(tmp_path / "l0.gguf", {0: rand(1), 1: rand(2)}, "llama")
    cases["layer0"] = tmp_path / "l0.gguf"
    write_control_vector(tmp_path / "mixed.gguf", {1: rand(1), 2: rand(2, n=32)}, "llama")
    cases["mixed"] = tmp_path / "mixed.gguf"
    for what, path in cases.items():
        with pytest.raises(ControlVectorError) as ei:
            ControlVector.load(path)
        assert str(path) in str(ei.value), what
        with pytest.raises(ControlVectorError):
            engine.set_control_vector(path)
    v32 = tmp_path / "v32.gguf"
    ControlVector({1: rand(1, n=32)}).save(v32)
    with pytest.raises(ControlVectorError, match="n_embd is 64"):
        engine.set_control_vector(v32)
    assert engine.control is None


def test_parse_layers():
    assert parse_layers("6-14") == (6, 14) and parse_layers("3") == (3, 3) and parse_layers(None) is None
    for bad in ("a-b", "5-2", "1-"):
        with pytest.raises(ParameterError):
            parse_layers(bad)


# ------------------------------------------------------------------------------------------- training
def test_direction_from_pairs_recovers_a_planted_direction():
    rng = np.random.default_rng(0)
    truth = rng.standard_normal(E)
    truth /= np.linalg.norm(truth)
    neg = rng.standard_normal((24, E)) * 3
    pos = neg + np.outer(rng.uniform(1.5, 2.5, 24), truth) + rng.standard_normal((24, E)) * 0.05
    for method in ("pca", "mean"):
        vec, st = direction_from_pairs(pos, neg, method)
        cos = float(vec @ truth / np.linalg.norm(vec))
        assert cos > 0.99, method  # right direction and sign (towards positive)
        assert abs(np.linalg.norm(vec) - 2.0) < 0.1 and st["agree"] == 1.0
    vec, _ = direction_from_pairs(neg, pos, "pca")
    assert float(vec @ truth) < 0  # swapping the roles flips the sign


def test_train_uses_the_residual_the_file_applies_to(eng4):
    pos = ["the cat sat on the mat", "hello world", "the dog ran"]
    neg = ["the dog sat on the mat", "hello big world", "the cat ran"]
    streams = [residual_stream(eng4, t) for t in pos + neg]
    for pool, reduce in (("last", lambda a: a[-1]), ("mean", lambda a: a.mean(axis=0))):
        cv = ControlVector.train(eng4, pos, neg, method="mean", pool=pool, progress=False)
        assert cv.layers == [1, 2, 3] and cv.model_hint == "llama" and set(cv.stats) == {1, 2, 3}
        for k in (1, 2, 3):
            expect = np.mean([reduce(streams[i][k].astype(np.float64)) - reduce(streams[i + 3][k])
                              for i in range(3)], axis=0)
            assert np.abs(cv.directions[k] - expect).max() < 1e-4, (pool, k)
    pca = ControlVector.train(eng4, pos, neg, layers=(2, 3), pool="mean", progress=False)
    assert pca.layers == [2, 3] and all(0 < pca.stats[k]["explained"] <= 1 for k in (2, 3))
    for bad in [dict(negative=neg[:2]), dict(method="svd"), dict(layers=(1, 4)), dict(pool="max")]:
        kw = dict(positive=pos, negative=neg, progress=False) | bad
        with pytest.raises(ParameterError):
            ControlVector.train(eng4, **kw)


def test_cli_cvec_train(tiny4, tmp_path, capsys):
    (tmp_path / "p.txt").write_text("the cat sat on the mat\n\nhello world\n")
    (tmp_path / "n.jsonl").write_text('{"text": "the dog sat on the mat"}\n{"text": "hello big world"}\n')
    assert read_examples(tmp_path / "n.jsonl") == ["the dog sat on the mat", "hello big world"]
    out = tmp_path / "v.gguf"
    rc = cli_main(["cvec", "train", str(tiny4), "--positive", str(tmp_path / "p.txt"), "--negative",
                   str(tmp_path / "n.jsonl"), "-o", str(out), "--method", "mean", "--layers", "1-2", "-q"])
    assert rc == 0
    printed = capsys.readouterr().out
    cv = ControlVector.load(out)
    assert cv.layers == [1, 2] and f"{cv.norms()[2]:.3f}" in printed
    (tmp_path / "n1.txt").write_text("one line\n")
    rc = cli_main(["cvec", "train", str(tiny4), "--positive", str(tmp_path / "p.txt"), "--negative",
                   str(tmp_path / "n1.txt"), "-o", str(tmp_path / "x.gguf"), "-q"])
    assert rc == 2 and "paired" in capsys.readouterr().err
    (tmp_path / "bad.jsonl").write_text('{"txt": 1}\n')
    with pytest.raises(ParameterError, match="line 1"):
        read_examples(tmp_path / "bad.jsonl")


# ------------------------------------------------------------------------------------------- real model
def _example_module():
    spec = importlib.util.spec_from_file_location("make_control_vector", REPO / "examples" / "make_control_vector.py")
    mod = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.gemma
def test_gemma_one_layer_convention(gemma):
    v = rand(5, 20.0, gemma.model.n_embd)
    setting = ControlSetting.build(gemma, [(ControlVector({7: v}), 1.0)])
    base = residual_stream(gemma, "The weather today", layers=range(9))
    got = residual_stream(gemma, "The weather today", layers=range(9), control=setting)
    assert all(max_diff(got[k], base[k]) == 0.0 for k in range(7))
    assert max_diff(got[7] - base[7], np.broadcast_to(v, base[7].shape)) < 1e-3 * float(np.abs(base[7]).max())
    assert max_diff(got[8], base[8]) > 1e-2


@pytest.mark.gemma
def test_gemma_happy_vector_steers_and_keeps_text_fluent(gemma):
    """Trained on the example's pairs; held-out margins rise through −α, 0, +α; neutral perplexity bounded."""
    ex = _example_module()
    cv = ControlVector.train(gemma, [p for p, _ in ex.TRAIN_PAIRS], [n for _, n in ex.TRAIN_PAIRS], progress=False)
    shipped = ControlVector.load(ex.OUT)
    for k in cv.layers:
        a, b = cv.directions[k], shipped.directions[k]
        assert float(a @ b) / float(np.linalg.norm(a) * np.linalg.norm(b)) > 0.99  # the shipped file is this
    alpha = ex.STRENGTH
    rows = ex.evaluate(gemma, cv, [-alpha, 0.0, alpha])
    (_, m_neg, p_neg, _), (_, m0, p0, _), (_, m_pos, p_pos, rose) = rows
    assert m_neg < m0 < m_pos
    assert m_pos - m0 > 1.0 and m0 - m_neg > 1.0  # nats, averaged over the held-out prompts
    assert rose >= len(ex.HELD_OUT) - 1
    assert max(p_neg, p_pos) / p0 < ex.PPL_BOUND and math.isfinite(p0)
