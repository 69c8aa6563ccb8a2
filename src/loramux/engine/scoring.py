"""Log-probabilities of prompt and generated tokens, computed on the engine thread.

A request that wants them carries a `Scoring`. The scheduler asks it which rows of a prompt chunk
need logits (only the rows that predict a scored token, at most `SCORE_ROWS` per decode over the
whole batch: llama.cpp reserves n_outputs × n_vocab floats, 64 MiB for 64 rows of Gemma 3's 262k
vocabulary), hands it each decoded row, and reports each sampled token. Each row becomes one
`TokenLogprob`: the log-softmax of the logits the engine computed under that request's own adapters,
read for the chosen token and the top N.

The arithmetic is `Context.token_nll`'s, operation for operation (float64, max-shifted log-sum-exp),
so the logprob of a prompt token is exactly the negated NLL that `Engine.loss` reports for it when
both decode the same batch.
"""

from __future__ import annotations

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
SCORE_ROWS = 64  # full-vocabulary logit rows per decode for prompt scoring, over the whole batch
# ... while a request that is not scoring its prompt runs too: its tokens wait for each of these decodes
# (a row of Gemma 3's 262k vocabulary takes 5-25 ms on 2 cores: 64 take a second; 2 keep a
# neighbour's step near its own length)
SCORE_ROWS_SHARED = 2


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
    r = row.astype(np.float64)
    m = r.max()
    shifted = r - m
    lse = m + np.log(np.exp(shifted, out=shifted).sum())  # token_nll's expression, without one temporary
    if not np.isfinite(lse):  # NaN or +Inf logits: no number to report (JSON has none for them either)
        raise FloatingPointError("the logits of this row are not finite (NaN or +Inf)")
    lp = -float(lse - r[token])  # the negation of token_nll's term, bit for bit
    # order questions are answered on the float32 row (float64 conversion is exact and monotone): half the bytes
    rank = int(np.count_nonzero(row > row[token])) + 1
    top: tuple[tuple[int, float], ...] = ()
    if top_n > 0:
        k = min(top_n, row.size)
        idx = np.argpartition(row, row.size - k)[row.size - k:]
        idx = idx[np.lexsort((idx, -row[idx]))]
        top = tuple((int(i), float(r[i] - lse)) for i in idx)
    return TokenLogprob(int(token), lp, top, rank)


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
