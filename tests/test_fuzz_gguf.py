"""Fuzzing the adapter load path with malformed GGUFs derived from valid adapters (tests/gguf_fuzz.py).

Every case must end as a typed loramux error or a valid load: never a crash, a hang or an untyped
exception. A case that passes the pre-validator is first loaded into llama.cpp in a child process,
so a segfault or an abort is reported with the case's name instead of killing pytest. After every
case the engine serves the base model bit-identically. The run is derandomized (the same 300+
cases every time); scripts/fuzz_adapters.py runs many more with random seeds.
"""

from __future__ import annotations

from collections import Counter
from datetime import timedelta

import pytest
from conftest import PROMPT
from gguf_fuzz import Fuzzer, Worker, build, cases, describe, seed_docs, serialize, write_seeds
from hypothesis import HealthCheck, given, settings

import loramux as lm

N_CASES = 600


@pytest.fixture(scope="module")
def fuzz(tiny_model, tmp_path_factory):
    d = tmp_path_factory.mktemp("fuzz")
    seeds = seed_docs(write_seeds(d))
    eng = lm.Engine.load(tiny_model, n_ctx=256, n_threads=2)
    worker = Worker(tiny_model, log=d / "worker.log")
    try:
        yield seeds, Fuzzer(eng, worker, d, PROMPT)
    finally:
        worker.close()
        eng.close()


def test_seeds_round_trip_and_load(fuzz):
    """The generator's starting points are valid adapters that load, in the child and in the engine."""
    seeds, fz = fuzz
    for i, doc in enumerate(seeds):
        res = fz.run(serialize(doc)[0], f"seed {i}")
        assert res.failure is None, res.failure
        assert res.outcome == "loaded", (i, res)


@pytest.mark.timeout(900)
def test_fuzzed_adapters_are_typed_errors_or_valid_loads(fuzz):
    seeds, fz = fuzz
    outcomes: Counter[str] = Counter()
    failures: list[str] = []

    @settings(max_examples=N_CASES, derandomize=True, database=None, deadline=timedelta(seconds=120),
              suppress_health_check=list(HealthCheck), print_blob=True)
    @given(case=cases(len(seeds)))
    def one(case):
        res = fz.run(build(seeds, case), describe(case))
        outcomes[res.outcome] += 1
        if res.failure:
            failures.append(res.failure)
        assert res.failure is None, res.failure

    one()
    print(f"\n{sum(outcomes.values())} fuzz cases: {dict(outcomes)}")
    assert failures == []
    assert sum(outcomes.values()) >= N_CASES
    # the generator reaches every stage: refusals by the pre-validator, and loads that get to llama.cpp
    assert outcomes["refused"] >= N_CASES // 4 and outcomes["loaded"] >= 10, outcomes
