"""Log-probabilities of prompt and generated tokens, computed on the engine thread.

A request that wants them carries a `Scoring`. The scheduler asks it which rows of a prompt chunk
need logits (only the rows that predict a scored token, at most `score_rows` per decode over the
whole batch, `SCORE_ROWS_SHARED` while another request runs), hands it each decoded row, and reports
each sampled token. A row is a large cost: llama.cpp's output projection for it (n_embd × n_vocab,
11-20 ms on Gemma 3 270M, 2 cores: about a whole one-token decode step) and here a pass over its
vocabulary, so a request that arrives while a scoring decode runs waits for all of that decode's rows:
they are few. Each row becomes one
`TokenLogprob`: the log-softmax of the logits the engine computed under that request's own adapters,
read for the chosen token and the top N.

The arithmetic is `Context.token_nll`'s, operation for operation (float64, max-shifted log-sum-exp),
so the logprob of a prompt token is exactly the negated NLL that `Engine.loss` reports for it when
both decode the same batch.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import numpy as np

from ..errors import ParameterError

if TYPE_CHECKING:
    from .. import _native as N
    from .registry import LoraArg

T = TypeVar("T")
MAX_TOP_LOGPROBS = 20  # alternatives per token (OpenAI's bound)
# Full-vocabulary logit rows per decode for prompt scoring, over the whole batch, while nothing else runs
# (the default of EngineOptions.score_rows). A row costs about what a whole decode step of one token costs
# on Gemma 3 270M (its 262,144-entry output projection: 11-20 ms on 2 cores, measured), and a request that
# arrives meanwhile waits for the decode: 8 rows keep that wait near 100 ms; 16 made pure scoring about 20 %
# faster and a neighbour 2.5-2.9x slower (BENCHMARKS.md, "Attacks beside a neighbour")
SCORE_ROWS = 8
# ... while a request that is not scoring its prompt runs too: its tokens wait for each of these decodes
SCORE_ROWS_SHARED = 1


@dataclass(frozen=True)
class TokenLogprob:
    """One token's log-probability under its request's adapters, and the top alternatives.

    `logprob` is None for the first prompt token (nothing predicts it). `top` holds up to N
    (token, logprob) pairs, most likely first (ties: lower token id first).
    """

    token: int
    logprob: float | None
    top: tuple[tuple[int, float], ...] = ()
    rank: int | None = None  # 1 + the number of tokens strictly more likely (vLLM's rank)


def row_logprob(row: np.ndarray, token: int, top_n: int = 0) -> TokenLogprob:
    """log p(token) from one row of logits, with the `top_n` most likely tokens."""
    lse = log_sum_exp(row)
    if not np.isfinite(lse):  # NaN or +Inf logits: no number to report (JSON has none for them either)
        raise FloatingPointError("the logits of this row are not finite (NaN or +Inf)")
    lp = -float(lse - np.float64(row[token]))  # the negation of token_nll's term, bit for bit
    # order questions are answered on the float32 row (float64 conversion is exact and monotone): half the bytes
    rank = int(np.count_nonzero(row > row[token])) + 1
    top: tuple[tuple[int, float], ...] = ()
    if top_n > 0:
        top = tuple((int(i), float(np.float64(row[i]) - lse)) for i in top_ids(row, top_n))
    return TokenLogprob(int(token), lp, top, rank)


_SCRATCH = threading.local()  # one float64 row per thread: a fresh 2 MiB array a row cost more than the math


def log_sum_exp(row: np.ndarray) -> float:
    """log Σ exp(row), in float64 and max-shifted: `Context.token_nll`'s expression, operation for operation
    (the same values summed the same way, so the same bits), into a reused buffer instead of two temporaries."""
    buf = getattr(_SCRATCH, "buf", None)
    if buf is None or buf.size < row.size:
        buf = _SCRATCH.buf = np.empty(row.size, np.float64)
    out = buf[:row.size]
    m = np.float64(row.max())
    np.subtract(row, m, out=out, dtype=np.float64)
    np.exp(out, out=out)
    return float(m + np.log(out.sum()))


TOP_BLOCK = 1024  # top_ids: the row's maxima per block of this many tokens bound the k-th largest value


def top_ids(row: np.ndarray, k: int) -> np.ndarray:
    """The ids of the `k` largest entries, largest first, ties by lower id; exact, in about one pass.

    The k-th largest of the block maxima is at most the row's k-th largest value (k blocks each hold one
    value at least that large), so every entry of the top k is at or above it: sorting only those is exact.
    A row with many equal values falls back to a partition of the whole row."""
    n = row.size
    k = min(k, n)
    blocks = n // TOP_BLOCK
    if blocks >= k:
        maxima = row[: blocks * TOP_BLOCK].reshape(blocks, TOP_BLOCK).max(axis=1)  # (a ragged tail only adds)
        edge = np.partition(maxima, maxima.size - k)[maxima.size - k]
        idx = np.flatnonzero(row >= edge)
        if idx.size > 64 * TOP_BLOCK:
            idx = _partition_top(row, n, k)
    else:
        idx = _partition_top(row, n, k)
    return idx[np.lexsort((idx, -row[idx]))][:k]


def _partition_top(row: np.ndarray, n: int, k: int) -> np.ndarray:
    """Every id whose value is at least the k-th largest (ties at the edge all included)."""
    edge = np.partition(row, n - k)[n - k]
    return np.flatnonzero(row >= edge)


def check_top(name: str, value: int | None) -> int | None:
    """Validate a top-N count (None: not wanted)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_TOP_LOGPROBS:
        raise ParameterError(name, f"must be an integer in [0, {MAX_TOP_LOGPROBS}], got {value!r}")
    return value


@dataclass
class Scoring:
    """Per-request scoring state. Only the engine thread touches it.

    prompt_top: top-N for prompt tokens (None: prompt tokens are not scored).
    gen_top: top-N for generated tokens (None: generated tokens are not scored).
    """

    prompt_top: int | None = None
    gen_top: int | None = None
    prompt: list[TokenLogprob] = field(default_factory=list)  # one per prompt token once prefilled
    generated: list[TokenLogprob] = field(default_factory=list)
    _rows: list[tuple[int, int]] = field(default_factory=list)  # (batch index, position) of this decode
    _sent: bool = False  # the whole prompt is scored and was reported

    @classmethod
    def wanted(cls, prompt_top: int | None, gen_top: int | None) -> Scoring | None:
        """A Scoring if either is asked for, else None (the request then costs nothing extra)."""
        if prompt_top is None and gen_top is None:
            return None
        return cls(check_top("prompt_logprobs", prompt_top), check_top("logprobs", gen_top))

    @property
    def scores_prompt(self) -> bool:
        return self.prompt_top is not None

    def chunk_end(self, n_past: int, end: int, rows_left: int) -> int:
        """Where a prompt chunk from n_past must stop so that its scored rows fit `rows_left`."""
        if not self.scores_prompt:
            return end
        return min(end, n_past + rows_left)

    def flags(self, batch_start: int, n_past: int, end: int, n_prompt: int, want_last: bool) -> list[bool]:
        """Which tokens of the chunk [n_past, end) need logits: every row that predicts a prompt token,
        and the last prompt token's row if the request generates. Remembers where they sit in the batch."""
        out = [(self.scores_prompt and p + 1 < n_prompt) or (want_last and p == n_prompt - 1)
               for p in range(n_past, end)]
        if self.scores_prompt:
            self._rows = [(batch_start + j, p) for j, p in enumerate(range(n_past, end)) if p + 1 < n_prompt]
        return out

    def collect(self, ctx: N.ContextHandle, prompt: Sequence[int], emit: Callable[[str, Any], None]) -> None:
        """After a decode: turn this request's marked rows into logprobs of the prompt tokens they predict;
        once the whole prompt is scored, emit ("prompt_logprobs", entries) (a stream's echo shows them)."""
        if not self.scores_prompt or self._sent:
            return
        from .. import _native as N  # here, not at import: sampling.py imports this module without llama.cpp
        if not self.prompt and prompt:
            self.prompt.append(TokenLogprob(int(prompt[0]), None))
        for idx, pos in self._rows:
            self.prompt.append(row_logprob(N.logits_view(ctx, idx), prompt[pos + 1], self.prompt_top or 0))
        self._rows = []
        if len(self.prompt) == len(prompt):
            self._sent = True
            emit("prompt_logprobs", list(self.prompt))

    def on_token(self, ctx: N.ContextHandle, idx: int, token: int) -> TokenLogprob | None:
        """A sampled token: its logprob from row `idx` (before the sampler changed anything), if wanted."""
        if self.gen_top is None:
            return None
        from .. import _native as N
        entry = row_logprob(N.logits_view(ctx, idx), token, self.gen_top)
        self.generated.append(entry)
        return entry


class Submitter(Protocol):
    """What `score_many` needs from an engine (`Engine` is one)."""

    def tokenize(self, text: str, *, add_bos: bool = True, special: bool = True) -> list[int]: ...

    def call(self, fn: Callable[[], T]) -> T: ...

    def submit(self, prompt: str | Sequence[int], **kwargs: Any) -> Any: ...


def score_many(engine: Submitter, prompts: Sequence[str | Sequence[int]],
               loras: Mapping[str, float] | Sequence[LoraArg] | None, top_logprobs: int,
               control: object) -> list[list[TokenLogprob]]:
    """`Engine.score`'s body: queue every prompt as a pure-scoring request (max_tokens 0) in one engine
    command, so that they all join the same decode steps, then wait for them.

    `loras`: a mapping (or None) is one adapter set for every prompt; a list holds one set per prompt."""
    sets = [loras] * len(prompts) if loras is None or isinstance(loras, Mapping) else list(loras)
    if len(sets) != len(prompts):
        raise ParameterError("loras", f"got {len(sets)} adapter sets for {len(prompts)} prompts")
    check_top("top_logprobs", top_logprobs)
    toks = [engine.tokenize(p) if isinstance(p, str) else list(p) for p in prompts]
    reqs = engine.call(lambda: [engine.submit(t, loras=s, control=control, max_tokens=0,
                                              prompt_logprobs=top_logprobs) for t, s in zip(toks, sets)])
    out = []
    try:
        for r in reqs:
            while True:
                kind, value = r.events.get()
                if kind == "error":
                    raise value
                if kind == "done":
                    out.append(list(value.prompt_logprobs or []))
                    break
    finally:
        for r in reqs:
            r.cancelled.set()  # a no-op for the finished ones; after an error, the rest stop
    return out


def sum_logprobs(entries: Sequence[TokenLogprob], start: int = 0) -> float:
    """Sum of the logprobs of entries[start:] (the first prompt token's None counts as 0), float64."""
    return float(sum(e.logprob for e in entries[start:] if e.logprob is not None))

__all__ = ["MAX_TOP_LOGPROBS", "SCORE_ROWS", "SCORE_ROWS_SHARED", "Scoring", "TokenLogprob", "check_top", "row_logprob", "score_many", "Submitter",
           "sum_logprobs"]
