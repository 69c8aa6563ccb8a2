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
