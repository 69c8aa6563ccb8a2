"""Known-answer probe and drift report, on the tiny model (real llama.cpp) and on the real default model."""

from __future__ import annotations

import json
from importlib.resources import files
from pathlib import Path

import numpy as np
import pytest
from tinymodel import write_tiny_model

import loramux as lm
from loramux.cli import main
from loramux.drift_report import drift, golden_prompts
from loramux.errors import ProbeMismatch
from loramux.gguf_io import read_adapter_factors, write_adapter
from loramux.probe_refs import (
    CROSS_BUILD_RTOL,
    REFERENCE_DIR,
    check_committed,
    committed_references,
    identity_distance,
    nearest_reference,
    reference_name,
    system_features,
)
from loramux.probes import EXACT_PAIRS, N_TOKENS, ROWS, ProbeResult, probe, probe_tokens

THREADS = 2  # part of the build identity: the committed references were made with 2 threads


def _stable(r: ProbeResult) -> dict:
    d = r.to_dict()
    d.pop("run")  # timestamp and elapsed time: the only fields allowed to differ run to run
    return d


@pytest.fixture(scope="module")
def ref(tiny_model: Path) -> ProbeResult:
    return probe(tiny_model, threads=THREADS)


@pytest.fixture(scope="module")
def ref_file(ref: ProbeResult, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ref.write(tmp_path_factory.mktemp("probe") / "ref.json")


# ------------------------------------------------------------------------------------------ probe
def test_probe_rows_and_invariants(ref: ProbeResult):
    assert list(ref.rows) == list(ROWS)
    assert ref.violations == []
    rows = ref.rows
    assert all(r.tokens == 4 * (N_TOKENS - 1) and len(r.per_prompt) == 4 for r in rows.values())
    # exact where the math says exact
    assert rows["zero"].per_prompt == rows["base"].per_prompt
    assert rows["dropped"].per_prompt == rows["base"].per_prompt
    assert rows["restored"].per_prompt == rows["adapter"].per_prompt
    # and clearly moved where it should move
    assert abs(rows["adapter"].loss - rows["base"].loss) > 1e-2
    assert rows["plus_eps"].loss != rows["minus_eps"].loss
    assert ref.build["threads"] == THREADS and ref.build["backend"] == "cpu"
    assert ref.adapter["file"] == "builtin" and ref.adapter["rank"] == 2 and ref.adapter["n_factors"] == 14


def test_probe_is_bit_identical_run_to_run(tiny_model: Path, ref: ProbeResult):
    # through the package's lazy export: `lm.probe` must be callable although loramux.probes is imported
    again = lm.probe(tiny_model, threads=THREADS)
    assert _stable(again) == _stable(ref)
    a, b = json.loads(again.to_json()), json.loads(ref.to_json())
    a.pop("run"), b.pop("run")
    assert a == b
    again.check(ref)  # exact equality passes


def test_probe_tokens_are_fixed_length(engine):
    toks = probe_tokens(engine.tokenize)
    assert [len(t) for t in toks] == [N_TOKENS] * 4
    short = probe_tokens(lambda text: [1, 7, 8, 9], n_tokens=10)  # padded by repeating the body
    assert short[0] == [1, 7, 8, 9, 7, 8, 9, 7, 8, 9]


def test_check_passes_against_own_reference_file(tiny_model: Path, ref: ProbeResult, ref_file: Path):
    run = probe(tiny_model, threads=THREADS, check=ref_file)
    loaded = ProbeResult.load(ref_file)
    assert _stable(loaded) == _stable(ref)  # the JSON file round-trips every float64 exactly
    assert run.rows["adapter"].nll_sum == loaded.rows["adapter"].nll_sum


def test_one_ulp_change_is_caught_and_named(ref: ProbeResult, tiny_model: Path):
    d = json.loads(ref.to_json())
    x = d["rows"]["minus_eps"]["per_prompt"][2]
    d["rows"]["minus_eps"]["per_prompt"][2] = float(np.nextafter(x, np.inf))
    nudged = ProbeResult.from_dict(d)
    run = probe(tiny_model, threads=THREADS)
    with pytest.raises(ProbeMismatch) as ei:
        run.check(nudged)
    assert set(ei.value.rows) == {"minus_eps"}
    assert "minus_eps" in str(ei.value) and "prompts moved: 2 (NLL Δ -" in str(ei.value)
    run.check(nudged, rtol=1e-12)  # within a stated tolerance it passes


def test_changed_adapter_factor_moves_the_adapter_rows(tiny_model: Path, tiny_dir: Path, tmp_path: Path):
    src = tiny_dir / "a.gguf"
    with_a = probe(tiny_model, src, threads=THREADS)
    assert with_a.violations == []
    factors = read_adapter_factors(src)
    name = sorted(factors)[3]
    a, b = factors[name]
    b = b.copy()
    b[0, 0] += 0.05  # one factor element changes
    factors[name] = (a, b)
    changed = write_adapter(tmp_path / "a.gguf", "llama", factors, 2.0)
    with pytest.raises(ProbeMismatch) as ei:
        probe(tiny_model, changed, threads=THREADS, check=with_a)
    moved = set(ei.value.rows)
    assert "adapter" in moved and "restored" in moved
    assert not moved & {"base", "zero", "dropped"}  # the base did not move: those stay exact
    assert "adapter (adapter θ as loaded): loss" in str(ei.value)


def test_reference_for_another_model_is_refused(tiny_dir: Path, ref_file: Path, tmp_path: Path):
    other = write_tiny_model(tmp_path / "tiny.gguf", seed=1)  # same shapes, other weights → other sha256
    with pytest.raises(ProbeMismatch) as ei:
        probe(other, threads=THREADS, check=ref_file)
    assert ei.value.rows == {}
    assert any(f.startswith("build.model_sha256") for f in ei.value.foreign)
    assert "different build" in str(ei.value) and "--write" in str(ei.value)
    run = probe(other, threads=THREADS)
    with pytest.raises(ProbeMismatch) as ei:  # another model is another experiment: no tolerance compares it
        run.check(ref_file, rtol=0.5)
    assert ei.value.rows == {} and "never comparable" in str(ei.value)


def test_reference_from_a_foreign_build_is_refused(ref: ProbeResult, tiny_model: Path, tmp_path: Path):
    d = json.loads(ref.to_json())
    d["build"]["binding_version"] = "0.3.20"
    d["build"]["system_info"] += " NOT_THIS_CPU = 1 |"  # differs from this build's whatever the CPU
    d["build"]["threads"] = 16
    path = tmp_path / "foreign.json"
    path.write_text(json.dumps(d))
    run = probe(tiny_model, threads=THREADS)
    with pytest.raises(ProbeMismatch) as ei:
        run.check(path)
    text = str(ei.value)
    assert "build.binding_version: reference '0.3.20'" in text
    assert "build.threads: reference 16, this run 2" in text
    assert "build.system_info" in text and "compares only within one build" in text


def _variant(ref: ProbeResult, scale: float = 1.0, **build) -> ProbeResult:
    """`ref` as if made by another build (`build` fields replaced), every float64 sum multiplied by `scale`."""
    d = json.loads(ref.to_json())
    d["build"].update(build)
    for row in d["rows"].values():
        row["nll_sum"] *= scale
        row["per_prompt"] = [x * scale for x in row["per_prompt"]]
    return ProbeResult.from_dict(d)


def test_foreign_build_is_compared_only_within_a_given_tolerance(ref: ProbeResult, tiny_model: Path):
    run = probe(tiny_model, threads=THREADS)
    other_cpu = {"system_info": ref.build["system_info"] + " NOT_THIS_CPU = 1 |"}  # another build on any CPU
    near = _variant(ref, 1 + 1e-4, **other_cpu)
    with pytest.raises(ProbeMismatch) as ei:  # no tolerance: refused, as between any two builds
        run.check(near)
    assert ei.value.rows == {} and "--rtol" in str(ei.value)
    cmp = run.check(near, rtol=1e-3)
    assert not cmp.exact and cmp.values == len(ROWS)  # across builds: each row's total NLL
    assert cmp.max_offset == pytest.approx(1e-4, rel=1e-3)
    assert [f.split(":")[0] for f in cmp.foreign] == ["build.system_info"]
    with pytest.raises(ProbeMismatch) as ei:  # beyond the tolerance every row is named
        run.check(_variant(ref, 1 + 2e-3, **other_cpu), rtol=1e-3)
    assert set(ei.value.rows) == set(ROWS) and "across builds" in str(ei.value)
    d = near.to_dict()
    d["rows"]["adapter"]["per_prompt"][1] *= 1.05  # one prompt moved, its row's total as it was
    one_prompt = ProbeResult.from_dict(d)
    assert run.check(one_prompt, rtol=1e-3).values == len(ROWS)
    with pytest.raises(ProbeMismatch) as ei:  # on one build (here: the same identity) prompts are compared
        run.check(ProbeResult.from_dict({**d, "build": ref.build}), rtol=1e-3)
    assert set(ei.value.rows) == {"adapter"} and "prompts moved: 1 (NLL Δ" in str(ei.value)
    for bad in (-1e-3, float("inf"), float("nan")):
        with pytest.raises(lm.ParameterError):
            run.check(near, rtol=bad)
    same = run.check(ref)
    assert same.exact and same.max_offset == 0.0 and same.foreign == [] and same.values == len(ROWS) * 5


def test_system_features_and_identity_distance():
    info = "CPU : SSE3 = 1 | AVX2 = 1 | FMA = 1 | REPACK = 1 | CUDA : ARCHS = 890 | USE_GRAPHS = 1 |"
    assert system_features(info) == {"CPU.SSE3": "1", "CPU.AVX2": "1", "CPU.FMA": "1", "CPU.REPACK": "1",
                                     "CUDA.ARCHS": "890", "CUDA.USE_GRAPHS": "1"}
    a = {"binding_version": "0.3.36", "system_info": "CPU : AVX = 1 | AVX2 = 1 | FMA = 1 |", "backend": "cpu",
         "threads": 2, "model_sha256": "m"}
    assert identity_distance(a, a) == (0, 0, 0, 0)
    assert identity_distance(a, {**a, "system_info": "CPU : AVX = 1 | AVX2 = 0 |"}) == (0, 0, 2, 0)
    assert identity_distance(a, {**a, "threads": 8}) == (0, 0, 0, 6)
    assert identity_distance(a, {**a, "binding_version": "0.3.20"}) == (1, 0, 0, 0)
    assert identity_distance(a, {**a, "model_sha256": "other"}) is None
    assert reference_name(a).startswith("avx2-t2-cpu-") and reference_name(a) != reference_name({**a, "threads": 4})


def test_nearest_reference_and_committed_check(ref: ProbeResult, tiny_model: Path):
    run = probe(tiny_model, threads=THREADS)
    feats = ref.build["system_info"]
    refs = {
        "same": ref,
        "threads": _variant(ref, 1 + 1e-3, threads=8),
        "one_feature": _variant(ref, 1 + 1e-3, system_info=feats + " EXTRA = 1 |"),
        "two_features": _variant(ref, 1 + 1e-3, system_info=feats + " EXTRA = 1 | MORE = 1 |"),
        "binding": _variant(ref, 1 + 1e-3, binding_version="0.0.1"),
        "model": _variant(ref, 1.0, model_sha256="0" * 64),
    }
    cmp = check_committed(run, refs)  # a reference of this very build: exact
    assert cmp.reference == "same" and cmp.exact and cmp.max_offset == 0.0
    del refs["same"]
    assert nearest_reference(run, refs)[0] == "threads"  # features weigh more than threads
    del refs["threads"]
    assert nearest_reference(run, refs)[0] == "one_feature"
    cmp = check_committed(run, refs)
    assert cmp.reference == "one_feature" and cmp.rtol == CROSS_BUILD_RTOL
    assert cmp.max_offset == pytest.approx(1e-3, rel=1e-2) and cmp.values == len(ROWS)
    refs["one_feature"] = _variant(ref, 1 + 1.5 * CROSS_BUILD_RTOL, system_info=feats + " EXTRA = 1 |")
    with pytest.raises(ProbeMismatch) as ei:  # the nearest one decides; a farther one that agrees does not
        check_committed(run, refs)
    assert set(ei.value.rows) == set(ROWS)
    broken = ProbeResult.from_dict(run.to_dict())
    broken.violations = ["invariant zero == base broken: 1.0 vs 2.0 (Δ -1.000e+00)"]
    with pytest.raises(ProbeMismatch) as ei:  # within tolerance, but an invariant broke
        check_committed(broken, {"two_features": refs["two_features"]})
    assert "1 invariant(s) broken" in str(ei.value)
    with pytest.raises(ProbeMismatch) as ei:
        check_committed(run, {"model": refs["model"]})
    assert "no committed probe reference" in str(ei.value)


def test_committed_references_are_named_by_their_build_and_hold_the_invariants():
    refs = committed_references()
    assert len(refs) >= 2, f"{REFERENCE_DIR} should hold a reference per build identity"
    for name, r in refs.items():
        assert name == reference_name(r.build), name
        assert r.violations == [] and r.build["threads"] == THREADS and r.adapter["file"] == "builtin"
        for a, b in EXACT_PAIRS:
            assert r.rows[a].per_prompt == r.rows[b].per_prompt, (name, a, b)
    assert len({json.dumps(r.setup, sort_keys=True) for r in refs.values()}) == 1
    assert len({r.build["model_sha256"] for r in refs.values()}) == 1
    assert len({reference_name(r.build) for r in refs.values()}) == len(refs)


def test_probe_on_a_busy_engine_leaves_it_as_it_was(engine, tiny_dir: Path, ref: ProbeResult):
    engine.set_lora(tiny_dir / "a.gguf", scale=0.7)
    before = engine.logits("the cat sat")
    r = probe(engine)  # the engine's default set must not leak into the rows
    assert _stable(r)["rows"] == _stable(ref)["rows"]
    assert engine.active == {"a": 0.7} and set(engine.adapters) == {"a"}
    assert np.array_equal(engine.logits("the cat sat"), before)


def test_zero_adapter_probe(tiny_model: Path, tiny_dir: Path):
    r = probe(tiny_model, tiny_dir / "zero.gguf", threads=THREADS)
    assert r.adapter["all_zero"] and r.violations == []
    assert r.rows["adapter"].per_prompt == r.rows["base"].per_prompt


# ------------------------------------------------------------------------------------------ drift
def test_golden_prompts(tmp_path: Path):
    assert len(golden_prompts()) == 8
    assert files("loramux").joinpath("data/golden_prompts.txt").is_file()  # shipped as package data
    f = tmp_path / "p.txt"
    f.write_text("# comment\nfirst\n\nsecond\\nline\n")
    assert golden_prompts(f) == ["first", "second\nline"]


def test_drift_of_zero_adapter_is_exactly_zero(engine, tiny_dir: Path):
    r = drift(engine, tiny_dir / "zero.gguf", prompts=["the cat sat on the mat", "hello world"], max_tokens=6)
    assert [i.kl for i in r.items] == [0.0, 0.0] and r.mean_kl == 0.0
    assert r.mean_top1_agreement == 1.0
    assert all(i.base_text == i.adapter_text for i in r.items)
    assert "loramux-drift" not in engine.adapters


def test_drift_grows_with_scale(engine, tiny_dir: Path):
    prompts = ["the cat sat on the mat and the dog ran", "hello world, it was a big red dog"]
    kls = [drift(engine, tiny_dir / "a.gguf", scale=s, prompts=prompts, max_tokens=4).mean_kl
           for s in (0.25, 0.5, 1.0)]
    assert 0.0 < kls[0] < kls[1] < kls[2], kls


def test_drift_report_renders(engine, tiny_dir: Path):
    engine.set_lora(tiny_dir / "b.gguf", scale=0.5)
    r = drift(engine, "b", scale=1.0, max_tokens=8)  # an adapter already loaded, by name
    assert len(r.items) == 8 and 0.0 <= r.mean_top1_agreement <= 1.0 and r.mean_kl > 0
    text = r.table()
    assert "mean KL(base ‖ adapter)" in text and "base (greedy)" in text
    assert json.loads(r.to_json())["prompts"][0]["prompt"] == golden_prompts()[0]
    assert engine.active == {"b": 0.5}


# ------------------------------------------------------------------------------------------ CLI
def test_cli_probe_write_check_and_exit_codes(tiny_model: Path, tiny_dir: Path, tmp_path: Path, capsys):
    ref = tmp_path / "ref.json"
    t = ["--threads", str(THREADS)]
    assert main(["probe", str(tiny_model), *t, "--write", str(ref)]) == 0
    assert ProbeResult.load(ref).rows["base"].tokens == 4 * (N_TOKENS - 1)
    assert main(["probe", str(tiny_model), *t, "--check", str(ref)]) == 0
    assert "0 (exact)" in capsys.readouterr().out
    # another adapter: the adapter rows move → exit 1, naming them
    assert main(["probe", str(tiny_model), *t, "--lora", str(tiny_dir / "a.gguf"), "--check", str(ref)]) == 1
    err = capsys.readouterr().err
    assert "adapter (adapter θ as loaded)" in err and "base (" not in err
    # another build → refused, exit 2
    d = json.loads(ref.read_text())
    d["build"]["binding_version"] = "9.9.9"
    foreign = tmp_path / "foreign.json"
    foreign.write_text(json.dumps(d))
    assert main(["probe", str(tiny_model), *t, "--check", str(foreign)]) == 2
    assert "different build" in capsys.readouterr().err
    assert main(["probe", str(tiny_model), *t, "--check", str(foreign), "--rtol", "1e-9"]) == 0  # told to compare
    err = capsys.readouterr().err
    assert "rtol 1e-09" in err and "reference from another build" in err and "build.binding_version" in err
    assert main(["probe", str(tiny_model), *t, "--check", str(foreign), "--rtol", "-1"]) == 2
    refdir = tmp_path / "refs"
    refdir.mkdir()
    assert main(["probe", str(tiny_model), *t, "--write", str(refdir)]) == 0  # a directory: named by build
    (written,) = refdir.iterdir()
    assert written.name == reference_name(ProbeResult.load(written).build) + ".json"
    assert main(["probe", str(tiny_model), *t, "--check", str(tmp_path / "missing.json")]) == 2
    assert main(["probe", str(tiny_model), *t, "--lora", str(tiny_dir / "a.gguf") + ":0.5"]) == 2
    assert "scale 1.0" in capsys.readouterr().err
    assert main(["probe", str(tiny_model), *t, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["format"] == "loramux-probe/1"
    assert main(["probe", str(tiny_model), *t, "--markdown"]) == 0
    assert "| `zero` |" in capsys.readouterr().out


def test_cli_drift(tiny_model: Path, tiny_dir: Path, capsys):
    args = ["drift", str(tiny_model), "--threads", str(THREADS), "--lora", str(tiny_dir / "a.gguf"),
            "--max-tokens", "4", "--json"]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["prompts"]) == 8 and out["mean_kl"] > 0 and out["scale"] == 1.0
    assert main(["drift", str(tiny_model), "--max-tokens", "2"]) == 2  # no --lora
    assert "--lora" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ Gemma
@pytest.fixture(scope="module")
def gemma_probe(gemma_path: Path) -> ProbeResult:
    return probe(gemma_path, threads=THREADS)


def _offsets(run: ProbeResult, ref: ProbeResult) -> str:
    return "\n".join(f"  {n:<10} mean NLL {run.rows[n].loss:.6f} vs {ref.rows[n].loss:.6f} "
                     f"(relative {run.rows[n].loss / ref.rows[n].loss - 1:+.3e})" for n in ROWS)


@pytest.mark.gemma
def test_default_model_matches_committed_reference(gemma_probe: ProbeResult):
    """Exact against the reference of this build if one is committed, else within CROSS_BUILD_RTOL of
    the nearest one; the within-run invariants hold exactly on any CPU build."""
    run, refs = gemma_probe, committed_references()
    for a, b in EXACT_PAIRS:  # checked here too, not only through run.violations
        assert run.rows[a].per_prompt == run.rows[b].per_prompt, (a, b)
    assert run.violations == [] and run.rows["adapter"].loss > run.rows["base"].loss * 1.1
    try:
        cmp = check_committed(run, refs)
    except ProbeMismatch as e:
        near = nearest_reference(run, refs)
        pytest.fail(f"probe on the default model vs the committed references:\n{e}\n\n"
                    + (f"nearest {near[0]}:\n{_offsets(run, near[1])}" if near else ""))
    used = refs[cmp.reference]
    if not run.foreign_keys(used):
        assert cmp.exact and cmp.max_offset == 0.0 and cmp.values == len(ROWS) * 5
    else:
        assert cmp.rtol == CROSS_BUILD_RTOL and cmp.foreign and cmp.max_offset <= CROSS_BUILD_RTOL
        assert cmp.values == len(ROWS) and not any(not run.foreign_keys(r) for r in refs.values())
    # negative control: the same comparison must reject a reference moved just beyond what it allows
    d = used.to_dict()
    x = d["rows"]["plus_eps"]["nll_sum"]
    d["rows"]["plus_eps"]["nll_sum"] = (float(np.nextafter(x, np.inf)) if cmp.exact
                                        else x * (1 + cmp.max_offset + 2 * CROSS_BUILD_RTOL))
    with pytest.raises(ProbeMismatch) as ei:
        check_committed(run, {**refs, cmp.reference: ProbeResult.from_dict(d)})
    assert set(ei.value.rows) == {"plus_eps"}


@pytest.mark.gemma
def test_default_model_within_cross_build_tolerance_of_every_other_build(gemma_probe: ProbeResult):
    """The nearest-reference path for real: every committed reference of another build is within
    CROSS_BUILD_RTOL of this run (and only a tolerance makes them comparable at all)."""
    others = {n: r for n, r in committed_references().items() if gemma_probe.foreign_keys(r)}
    if not others:
        pytest.skip("every committed reference is of this build")
    for name, ref in others.items():
        with pytest.raises(ProbeMismatch):
            gemma_probe.check(ref)  # refused without a tolerance
        try:
            cmp = check_committed(gemma_probe, {name: ref})
        except ProbeMismatch as e:
            pytest.fail(f"{name}:\n{e}\n\n{_offsets(gemma_probe, ref)}")
        assert cmp.reference == name and cmp.foreign and cmp.values == len(ROWS)
        assert cmp.max_offset <= CROSS_BUILD_RTOL
