"""The probe references that ship with loramux, one per build identity, and the choice among them.

On one build (binding version, llama.cpp's system info, backend, threads, model file) the probe's
losses are bit-identical run to run, so a run is compared *exactly* with the reference of its own
build. Builds with other CPU kernels (AVX-512 vs AVX2 vs no AVX2, ARM) differ by small offsets, so
when no committed reference has this run's build identity the run is compared with the *nearest*
reference (`identity_distance`) within `CROSS_BUILD_RTOL` on each row's total NLL, after its
within-run invariants (exact on any CPU build) have been checked. The offsets behind that tolerance are tabled in docs/probe.md.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from .config import data_file
from .errors import ProbeMismatch
from .probes import BUILD_FIELDS, ProbeComparison, ProbeResult

REFERENCE_DIR = "probe_references"  # in loramux's package data (config.data_file): <reference_name(build)>.json per build identity
# Relative tolerance on each row's total NLL (its mean loss) against a reference of another build
# (per-prompt sums are not compared across builds: they moved by up to 3.2 %). Largest measured
# cross-build row offset (docs/probe.md): 0.66 % (minus_eps, AVX2 vs a build without AVX2/FMA/F16C);
# 2 % is 3× that. A lost adapter (28 % off on its rows) or a lost control of the rows is still caught.
CROSS_BUILD_RTOL = 0.02
# Most advanced SIMD family first: the readable part of a reference's file name.
_SIMD_TAGS = (("AVX512", "avx512"), ("AVX2", "avx2"), ("AVX", "avx"), ("SSE3", "sse3"), ("SVE", "sve"),
              ("NEON", "neon"))


def system_features(info: str) -> dict[str, str]:
    """llama.cpp's system info (`CPU : SSE3 = 1 | AVX = 1 | … |`) as {"CPU.SSE3": "1", …}."""
    out, section = {}, ""
    for part in info.split("|"):
        if "=" not in part and ":" not in part:
            continue
        if ":" in part.split("=", 1)[0]:
            section, part = (s.strip() for s in part.split(":", 1))
        if "=" in part:
            key, value = (s.strip() for s in part.split("=", 1))
            out[f"{section}.{key}"] = value
    return out


def identity_distance(a: Mapping[str, Any], b: Mapping[str, Any]) -> tuple[int, int, int, int] | None:
    """How far apart two build identities are, compared as a tuple (smaller is nearer); None when they
    are for different model files (never comparable).

    In order of weight: another binding version (any kernel may have changed), another backend,
    the number of system-info entries that differ (CPU features pick kernels; an entry present on one
    side only counts), and the difference in thread count (it changes how work is split).
    """
    if a.get("model_sha256") != b.get("model_sha256"):
        return None
    fa, fb = system_features(str(a.get("system_info", ""))), system_features(str(b.get("system_info", "")))
    features = sum(fa.get(k) != fb.get(k) for k in set(fa) | set(fb))
    threads = abs(int(a.get("threads") or 0) - int(b.get("threads") or 0))
    return (int(a.get("binding_version") != b.get("binding_version")), int(a.get("backend") != b.get("backend")),
            features, threads)


def reference_name(build: Mapping[str, Any]) -> str:
    """File stem for a reference of this build: `<simd>-t<threads>-<backend>-<digest of the identity>`."""
    feats = system_features(str(build.get("system_info", "")))
    simd = next((tag for key, tag in _SIMD_TAGS if feats.get(f"CPU.{key}") == "1"), "generic")
    backend = "cpu" if build.get("backend") == "cpu" else "gpu"
    ident = json.dumps({k: build.get(k) for k in BUILD_FIELDS}, sort_keys=True)
    return f"{simd}-t{build.get('threads')}-{backend}-{hashlib.sha256(ident.encode()).hexdigest()[:10]}"


def committed_references(directory: str | Path | None = None) -> dict[str, ProbeResult]:
    """The references shipped with loramux (or those in `directory`), by file stem."""
    root = data_file(REFERENCE_DIR) if directory is None else Path(directory)
    out = {}
    for entry in sorted(root.iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".json"):
            name = entry.name[: -len(".json")]
            out[name] = ProbeResult.from_dict(json.loads(entry.read_text()), f"{REFERENCE_DIR}/{entry.name}")
    return out


def nearest_reference(run: ProbeResult, refs: Mapping[str, ProbeResult]
                      ) -> tuple[str, ProbeResult, tuple[int, int, int, int]] | None:
    """The reference nearest to `run`'s build identity among those with its model file and probe
    setup (ties: the first name in sort order), or None if there is none."""
    best = None
    for name in sorted(refs):
        ref = refs[name]
        dist = identity_distance(run.build, ref.build)
        if dist is None or ref.setup != run.setup:
            continue
        if best is None or dist < best[2]:
            best = (name, ref, dist)
    return best


def pick_reference(run: ProbeResult, refs: Mapping[str, ProbeResult] | None = None) -> tuple[str, ProbeResult, bool]:
    """The committed reference to check `run` against: (name, reference, True) for the one of its own build,
    else (name, reference, False) for the nearest one. Raises ProbeMismatch when none is for this model file
    and probe setup."""
    refs = committed_references() if refs is None else refs
    for name in sorted(refs):
        if not run.foreign_keys(refs[name]):
            return name, refs[name], True
    near = nearest_reference(run, refs)
    if near is None:
        raise ProbeMismatch(
            "no committed probe reference is for this model file and probe setup",
            problems=[f"{n}: " + "; ".join(run.foreign_fields(r)) for n, r in sorted(refs.items())],
            hint="the committed references are for loramux's default model; write one for your model with "
                 "`loramux probe MODEL --write REF.json` and check against it")
    return near[0], near[1], False


def check_committed(run: ProbeResult, refs: Mapping[str, ProbeResult] | None = None,
                    rtol: float = CROSS_BUILD_RTOL) -> ProbeComparison:
    """Check `run` against the committed references: exactly against the one of its own build if there
    is one, else within `rtol` against the nearest one. Either way the run's within-run invariants
    must hold. Returns what was compared (`.reference` is the reference's name); raises ProbeMismatch
    on any difference, and when no reference is for this model file and probe setup."""
    name, ref, own = pick_reference(run, refs)
    return replace(run.check(ref) if own else run.check(ref, rtol), reference=name)


__all__ = ["CROSS_BUILD_RTOL", "REFERENCE_DIR", "check_committed", "committed_references", "identity_distance",
           "nearest_reference", "pick_reference", "reference_name", "system_features"]
