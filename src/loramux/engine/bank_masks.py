"""The slot bank's per-token masks: which rows of each bank A·x node a token keeps, at what scale.

`Mask` holds the values of one node shape (tokens × K·r) and applies them in place (dropped entries
selected to exactly 0, kept ones scaled); `MaskPlan` is one decode's masks, one pair per ubatch in
llama.cpp's processing order; `plan_ubatches` predicts that order. The bank (bank.py) builds a plan
before each decode and applies it from the eval callback.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class Mask:
    """Mask values of one node shape: `values` (n_tok, width) and which entries are kept."""

    values: np.ndarray
    keep: np.ndarray = field(init=False)
    drop: np.ndarray = field(init=False)
    mode: int = field(init=False)  # 0: keep none, 1: keep all, 2: mixed
    _segments: list[tuple[int, int, bool]] | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.keep = self.values != 0
        self.drop = ~self.keep
        self.mode = 1 if self.keep.all() else 0 if not self.keep.any() else 2

    def segments(self) -> list[tuple[int, int, bool]]:
        """Runs [r0, r1) of token rows the mask changes, and whether each run must be read first.

        A row whose every value is exactly 1 is left as it is (x·1 == x); a row that keeps nothing is
        written as zeros without being read; the rest are read, masked and written back. Consecutive
        rows of one kind form one run, so a device transfers each run in one call.
        """
        if self._segments is None:
            identity = self.keep.all(axis=1) & (self.values == 1).all(axis=1)
            kind = np.where(identity, 0, np.where(self.drop.all(axis=1), 1, 2))
            edges = np.flatnonzero(np.diff(kind)) + 1
            starts = np.concatenate(([0], edges)).astype(int)
            ends = np.concatenate((edges, [len(kind)])).astype(int)
            self._segments = [(int(a), int(b), bool(kind[a] == 2)) for a, b in zip(starts, ends)
                              if len(kind) and kind[a] != 0]
        return self._segments

    def apply_rows(self, x: np.ndarray, r0: int, r1: int) -> None:
        """`apply` for rows [r0, r1) only (x holds just those rows): the same operations, so the same bits."""
        np.copyto(x, 0.0, where=self.drop[r0:r1])
        x *= self.values[r0:r1]

    def apply(self, x: np.ndarray) -> None:
        """Set the dropped entries of `x` to exactly 0, then scale the kept ones, in place.

        Zeroing first means no product ever meets an Inf or NaN of a dropped entry (x·0 would give NaN).
        """
        mode = self.mode
        if mode == 2:
            np.copyto(x, 0.0, where=self.drop)
            x *= self.values
        elif mode == 1:
            x *= self.values
        else:
            x.fill(0.0)


@dataclass
class MaskPlan:
    """Per-token masks of one decode, one (full, out) pair per ubatch in llama.cpp's processing order.

    `full` has a row per token of the ubatch (in the ubatch's token order), `out` the rows of the
    tokens that request logits (what remains in the last block).
    """

    ubatches: list[tuple[Mask, Mask]]
    per_ubatch: int  # bank nodes each ubatch's graph holds
    masked: int = 0
    problems: list[str] = field(default_factory=list)


def plan_ubatches(seq_ids: np.ndarray, n_ubatch: int, unified: bool) -> list[np.ndarray]:
    """The batch indices of each ubatch, as llama.cpp's batch allocator will split this batch.

    Unified KV cache: consecutive slices (`split_simple`). Otherwise `split_equal(sequential)`: each
    ubatch takes runs of consecutive sequence ids and the same number of tokens from each, grouped
    by sequence. One sequence per token (no coupled sequences), as the scheduler builds batches.
    """
    n = len(seq_ids)
    if unified:
        return [np.arange(i, min(i + n_ubatch, n)) for i in range(0, n, n_ubatch)]
    used = np.zeros(n, bool)
    out = []
    while not used.all():
        cur: list[int] = []
        for i in range(n):
            s = int(seq_ids[i])
            if used[i] or s in cur or (cur and s != cur[-1] + 1):
                continue
            cur.append(s)
            if len(cur) > n_ubatch:
                break
        queues = [[i for i in range(n) if not used[i] and seq_ids[i] == s] for s in cur]
        per: list[list[int]] = [[] for _ in cur]
        while all(len(q) > len(p) for q, p in zip(queues, per)):
            for q, p in zip(queues, per):
                p.append(q[len(p)])
                used[q[len(p) - 1]] = True
            if (len(per[0]) + 1) * len(cur) > n_ubatch:
                break
        out.append(np.array([i for p in per for i in p], dtype=np.int64))
    return out


__all__ = ["Mask", "MaskPlan", "plan_ubatches"]
