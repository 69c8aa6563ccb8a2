"""The per-row arithmetic of scoring (engine/scoring.py) on vocabulary-sized rows: the top N found through
block maxima equals a full sort's, ties by lower id, and the log-sum-exp is token_nll's bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

from loramux.engine.scoring import TOP_BLOCK, log_sum_exp, row_logprob, top_ids


def _rows() -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    n = 64 * TOP_BLOCK + 123  # many blocks and a ragged tail
    plain = (rng.standard_normal(n) * 4).astype(np.float32)
    ties = np.round(plain).astype(np.float32)  # thousands of equal values at every level
    tail_top = plain.copy()
    tail_top[-5:] = 50.0  # the largest values all in the tail block
    spiky = np.full(n, -np.inf, np.float32)
    spiky[rng.choice(n, 30, replace=False)] = rng.standard_normal(30).astype(np.float32)
    flat = np.ones(n, np.float32)  # every value equal: the fallback
    return [plain, ties, tail_top, spiky, flat]


@pytest.mark.parametrize("k", [1, 5, 20])
@pytest.mark.parametrize("i", range(5))
def test_top_ids_equal_a_full_sort(i, k):
    row = _rows()[i]
    want = np.lexsort((np.arange(row.size), -row))[:k]  # by value, largest first; ties: lower id first
    assert top_ids(row, k).tolist() == want.tolist()


def test_log_sum_exp_is_token_nlls_expression():
    for row in _rows()[:3]:
        r = row.astype(np.float64)
        m = r.max()
        assert log_sum_exp(row) == m + np.log(np.exp(r - m).sum())  # Context.token_nll's, exactly
        e = row_logprob(row, 17, 3)
        assert e.logprob == -float(m + np.log(np.exp(r - m).sum()) - r[17])
        assert e.rank == int((row > row[17]).sum()) + 1


def test_score_rows_bounds_the_rows_of_every_decode(tiny_model):
    """`score_rows` (an engine option and a server setting) is the most prompt-scoring rows one decode
    computes: a 60-token prompt takes at least ceil(59 / 4) decodes at 4 rows, and at most 3 at 32."""
    import math

    import loramux as lm
    from loramux.errors import ParameterError
    from loramux.server.config import ServerSettings

    steps = {}
    for rows in (4, 32):
        eng = lm.Engine.load(tiny_model, n_ctx=256, n_threads=2, score_rows=rows)
        try:
            toks = (eng.tokenize("the cat sat on the mat and the dog ran") * 8)[:60]
            before = eng.stats().decode_steps
            [entries] = eng.score([toks])
            assert len(entries) == 60 and all(e.logprob is not None for e in entries[1:])
            steps[rows] = eng.stats().decode_steps - before
        finally:
            eng.close()
    assert steps[4] >= math.ceil(59 / 4) and steps[32] <= 3, steps
    with pytest.raises(ParameterError, match="score_rows"):
        lm.EngineOptions(score_rows=0)
    assert ServerSettings(score_rows=8).engine_options().score_rows == 8
