"""Sampling: llama.cpp's sampler chain (`SamplerHandle`, penalties), the lazy GBNF grammar sampler
(`GrammarHandle`), `sampler_accept`, and the binding's JSON-schema → GBNF converter re-exported so the
engine reaches the binding through this package only.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..errors import BackendError
from .handles import ContextHandle, Handle, ModelHandle
from .lib import C, grammar_log

# --------------------------------------------------------------------------------------------
# Samplers
# --------------------------------------------------------------------------------------------

class SamplerHandle(Handle):
    """llama.cpp's sampler chain: logit bias → penalties → top_k → top_p → min_p → temperature → dist (or
    greedy); with `order`, llama-server's chain of the named samplers in that order (`_ordered`)."""

    _free = staticmethod(C.llama_sampler_free)

    @classmethod
    def chain(cls, model: ModelHandle, *, temperature: float, top_k: int, top_p: float, min_p: float,
              repeat_penalty: float, repeat_last_n: int, frequency_penalty: float, presence_penalty: float,
              seed: int, logit_bias: Sequence[tuple[int, float]] = (), order: Sequence[str] | None = None,
              extra: dict[str, Any] | None = None) -> SamplerHandle:
        """The chain. `order` (llama-server's sampler names) builds llama-server's chain (`_ordered`), with
        `extra`'s settings (typical_p, xtc_*, dry_*, mirostat*); without it, loramux's fixed chain."""
        ch = C.llama_sampler_chain_init(C.llama_sampler_chain_default_params())
        h = cls(ch)
        add = lambda s: C.llama_sampler_chain_add(ch, s)  # noqa: E731 - the chain owns each sampler
        if logit_bias:  # first, as llama.cpp's common sampler puts it: every later sampler sees the biased logits
            arr = (C.llama_logit_bias * len(logit_bias))(*[C.llama_logit_bias(t, b) for t, b in logit_bias])
            add(C.llama_sampler_init_logit_bias(model.n_vocab, len(logit_bias), arr))  # it copies the array
        args = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "min_p": min_p,
                "repeat_penalty": repeat_penalty, "repeat_last_n": repeat_last_n,
                "frequency_penalty": frequency_penalty, "presence_penalty": presence_penalty, "seed": seed,
                **(extra or {})}
        if order is not None:
            _ordered(model, add, order, args)
            return h
        if repeat_penalty != 1.0 or frequency_penalty or presence_penalty:
            add(_penalties(model, repeat_last_n, repeat_penalty, frequency_penalty, presence_penalty))
        if temperature <= 0:
            add(C.llama_sampler_init_greedy())
            return h
        if top_k > 0:
            add(C.llama_sampler_init_top_k(top_k))
        if top_p < 1.0:
            add(C.llama_sampler_init_top_p(top_p, 1))
        if min_p > 0:
            add(C.llama_sampler_init_min_p(min_p, 1))
        add(C.llama_sampler_init_temp(temperature))
        add(C.llama_sampler_init_dist(seed & 0xFFFFFFFF))
        return h

    def sample(self, ctx: ContextHandle, idx: int) -> int:
        return int(C.llama_sampler_sample(self.ptr, ctx.ptr, idx))

    def accept(self, token: int) -> None:
        C.llama_sampler_accept(self.ptr, token)


DRY_BREAKERS = ("\n", ":", "\"", "*")  # llama-server's default dry_sequence_breakers


def _ordered(model: ModelHandle, add: Callable[[Any], None], order: Sequence[str], a: dict[str, Any]) -> None:
    """llama-server's chain (common_sampler_init): the named samplers in order, then dist; with mirostat,
    temperature then mirostat (v1 or v2) alone, as there. Each sampler at its neutral value is a no-op in
    llama.cpp, so it is left out when neutral (the same tokens, one step fewer)."""
    seed = a["seed"] & 0xFFFFFFFF
    mirostat = a.get("mirostat", 0)
    if mirostat:
        add(C.llama_sampler_init_temp(a["temperature"]))
        tau, eta = a.get("mirostat_tau", 5.0), a.get("mirostat_eta", 0.1)
        add(C.llama_sampler_init_mirostat(model.n_vocab, seed, tau, eta, 100) if mirostat == 1
            else C.llama_sampler_init_mirostat_v2(seed, tau, eta))
        return
    for name in order:
        s = _one(model, name, a, seed)
        if s is not None:
            add(s)
    add(C.llama_sampler_init_dist(seed))


def _one(model: ModelHandle, name: str, a: dict[str, Any], seed: int) -> Any:
    """One named sampler of llama-server's chain, or None where it would do nothing."""
    if name == "penalties":
        if a["repeat_penalty"] == 1.0 and not a["frequency_penalty"] and not a["presence_penalty"]:
            return None
        return _penalties(model, a["repeat_last_n"], a["repeat_penalty"], a["frequency_penalty"],
                          a["presence_penalty"])
    if name == "dry":
        if not a.get("dry_multiplier"):
            return None
        breakers = [b.encode("utf-8") for b in a.get("dry_sequence_breakers") or DRY_BREAKERS]
        arr = (ctypes.c_char_p * len(breakers))(*breakers)
        return C.llama_sampler_init_dry(model.vocab, a["dry_multiplier"], a.get("dry_base", 1.75),
                                        a.get("dry_allowed_length", 2), a.get("dry_penalty_last_n", 64),
                                        arr, len(breakers))  # it copies the strings
    if name == "top_k":
        return C.llama_sampler_init_top_k(a["top_k"]) if a["top_k"] > 0 else None
    if name == "typ_p":
        p = a.get("typical_p", 1.0)
        return C.llama_sampler_init_typical(p, 1) if p < 1.0 else None
    if name == "top_p":
        return C.llama_sampler_init_top_p(a["top_p"], 1) if a["top_p"] < 1.0 else None
    if name == "min_p":
        return C.llama_sampler_init_min_p(a["min_p"], 1) if a["min_p"] > 0 else None
    if name == "xtc":
        p, t = a.get("xtc_probability", 0.0), a.get("xtc_threshold", 0.1)
        return C.llama_sampler_init_xtc(p, t, 1, seed) if p > 0 and t <= 0.5 else None
    if name == "temperature":
        return C.llama_sampler_init_temp(a["temperature"])
    if name == "infill":
        return C.llama_sampler_init_infill(model.vocab)
    raise ValueError(f"unknown sampler {name!r}")


def _penalties(model: ModelHandle, last_n: int, repeat: float, freq: float, present: float) -> Any:
    argtypes = getattr(C.llama_sampler_init_penalties, "argtypes", None) or []
    if len(argtypes) == 5:  # some bindings take n_vocab first
        return C.llama_sampler_init_penalties(model.n_vocab, last_n, repeat, freq, present)
    return C.llama_sampler_init_penalties(last_n, repeat, freq, present)


# --------------------------------------------------------------------------------------------
# Grammar-constrained sampling (structured output, tool calls)
# --------------------------------------------------------------------------------------------

GREEDY_SCAN = 64  # greedy: allowed-token checks before a full grammar pass over the vocabulary
MASK_CHUNK = 4096  # candidates per grammar call of a pass with a deadline (checked between calls)
_TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)], align=True)


class GrammarHandle(Handle):
    """One request's GBNF grammar sampler (`llama_sampler_init_grammar`), used the lazy way llama-server's
    common sampler uses it: the unconstrained choice is checked against the grammar first (one candidate),
    and only a rejected choice pays for a pass of the grammar over the whole vocabulary."""

    _free = staticmethod(C.llama_sampler_free)
    #: False: mask the whole vocabulary for every token (the reference the lazy checks must equal)
    lazy = True

    @classmethod
    def create(cls, model: ModelHandle, gbnf: str, root: str = "root") -> GrammarHandle:
        """Parse `gbnf`; a grammar llama.cpp refuses raises BackendError with llama.cpp's own messages."""
        grammar_log.lines = []
        try:
            ptr = C.llama_sampler_init_grammar(model.vocab, gbnf.encode("utf-8"), root.encode("utf-8"))
            lines = list(grammar_log.lines)
        finally:
            grammar_log.lines = None
        if not ptr:
            raise BackendError("llama_sampler_init_grammar", None,
                               " ".join(" ".join(lines).split()) or "the grammar does not parse")
        return cls(ptr, model.n_vocab)

    def __init__(self, ptr: Any, n_vocab: int) -> None:
        super().__init__(ptr)
        self.n_vocab = n_vocab
        self._one = np.zeros(1, dtype=_TOKEN_DATA)
        self._all: np.ndarray | None = None  # the whole-vocabulary candidates, allocated on first rejection
        self._allowed: int | None = None  # the token the last pick found allowed (accept skips its check)

    def _apply(self, smpl: Any, data: np.ndarray) -> int:
        arr = C.llama_token_data_array(data.ctypes.data_as(ctypes.POINTER(C.llama_token_data)), len(data), -1, False)
        C.llama_sampler_apply(smpl, ctypes.byref(arr))
        return int(arr.selected)

    def allows(self, token: int) -> bool:
        """Whether the grammar, in its current state, accepts `token` next (a one-candidate check)."""
        one = self._one
        one["id"], one["logit"], one["p"] = token, 0.0, 0.0
        self._apply(self.ptr, one)
        return bool(np.isfinite(one["logit"][0]))

    def allowed_among(self, tokens: np.ndarray, deadline: float | None = None,
                      clock: Callable[[], float] = time.thread_time) -> np.ndarray:
        """Which of `tokens` the grammar, in its current state, accepts next (one pass over just those)."""
        data = np.zeros(len(tokens), dtype=_TOKEN_DATA)
        data["id"] = tokens
        self._mask(data, deadline, clock)
        return np.isfinite(data["logit"])

    def _candidates(self, ctx: ContextHandle, idx: int) -> np.ndarray:
        ptr = C.llama_get_logits_ith(ctx.ptr, idx)
        if not ptr:
            raise BackendError("llama_get_logits_ith", None, f"no logits for row {idx}")
        if self._all is None:
            self._all = np.zeros(self.n_vocab, dtype=_TOKEN_DATA)
        a = self._all
        a["id"] = np.arange(self.n_vocab, dtype=np.int32)
        a["logit"] = np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))
        a["p"] = 0.0
        return a

    def pick(self, ctx: ContextHandle, idx: int, chain: SamplerHandle | None, ban: np.ndarray | None = None,
             deadline: float | None = None, narrow: Callable[[], np.ndarray | None] | None = None,
             clock: Callable[[], float] = time.thread_time) -> int:
        """The next token under the grammar: greedy (`chain` None) or through the chain, without accepting it.

        `ban` (a boolean mask over the vocabulary) removes tokens on top of the grammar. `deadline` (a
        `clock()` value, by default time.thread_time(): this thread's CPU time, which waiting for the GIL or
        a core does not spend): the checks and the pass over the vocabulary raise TimeoutError once it is past, between
        two grammar calls (one call cannot be interrupted; a pass goes in chunks). `narrow`, called only
        when a pass over the vocabulary is needed, returns a mask of tokens the grammar is known to refuse
        (or None): the pass then asks the grammar about the others only, with the same result."""
        self._allowed = None
        if chain is None:
            tok = ctx.argmax(idx)
        else:
            cand = self._candidates(ctx, idx)
            tok = int(cand["id"][self._apply(chain.ptr, cand)])
        if self.lazy and (ban is None or not ban[tok]) and self.allows(tok):
            self._allowed = tok
            return tok
        if chain is None and self.lazy:  # greedy: the best allowed token is nearly always among the best few
            best = self._best_allowed(ctx, idx, ban, GREEDY_SCAN, deadline, clock)
            if best is not None:
                self._allowed = best
                return best
        known = narrow() if narrow is not None else None
        if known is not None:
            ban = known if ban is None else ban | known
        cand = self._candidates(ctx, idx)
        if ban is None:
            self._mask(cand, deadline, clock)  # rejected: mask the whole vocabulary (in id order), then choose again
        else:  # only the tokens not banned already need the grammar's verdict
            keep = np.flatnonzero(~ban)
            sub = cand[keep]
            self._mask(sub, deadline, clock)
            cand["logit"][keep] = sub["logit"]
            cand["logit"][ban] = -np.inf
        if not np.isfinite(cand["logit"]).any():
            raise BackendError("llama_sampler_apply", None, "the grammar allows no token here (a dead end)")
        if chain is None:
            tok = int(cand["logit"].argmax())
        else:
            tok = int(cand["id"][self._apply(chain.ptr, cand)])
        if np.isfinite(self._all_logit(tok)):
            self._allowed = tok
        return tok

    def _all_logit(self, token: int) -> float:
        """The masked logit of `token` after a full pass (the chain may have reordered the candidates)."""
        a = self._all
        assert a is not None
        hit = np.flatnonzero(a["id"] == token)
        return float(a["logit"][hit[0]]) if len(hit) else -np.inf

    def _mask(self, cand: np.ndarray, deadline: float | None, clock: Callable[[], float] = time.thread_time) -> None:
        """The grammar's pass over `cand`, MASK_CHUNK candidates a call when there is a deadline (llama.cpp
        checks each candidate on its own, so the chunks mask what one call would), checked between calls."""
        step = max(len(cand), 1) if deadline is None else MASK_CHUNK
        for start in range(0, len(cand), step):
            if deadline is not None and clock() > deadline:
                raise TimeoutError("the grammar's pass over the vocabulary ran past its deadline")
            self._apply(self.ptr, cand[start:start + step])

    def _best_allowed(self, ctx: ContextHandle, idx: int, ban: np.ndarray | None, k: int,
                      deadline: float | None = None, clock: Callable[[], float] = time.thread_time) -> int | None:
        """The highest-logit token the grammar allows among the `k` best (ties: the lowest id, as argmax over
        the masked vocabulary would pick), or None to fall back to the full pass."""
        ptr = C.llama_get_logits_ith(ctx.ptr, idx)
        if not ptr:
            raise BackendError("llama_get_logits_ith", None, f"no logits for row {idx}")
        row = np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))
        top = np.sort(np.argpartition(row, -k)[-k:])
        kth = row[top].min()
        for t in top[np.argsort(-row[top], kind="stable")]:
            if row[t] == kth and (row > kth).sum() + (row == kth).sum() > k:
                return None  # ties at the edge of the window: a token outside it could rank the same
            if deadline is not None and clock() > deadline:
                raise TimeoutError("the grammar's checks ran past their deadline")
            if (ban is None or not ban[t]) and self.allows(int(t)):
                return int(t)
        return None

    def accept(self, token: int) -> None:
        """Advance the grammar by a token it allows. llama.cpp ends the process on a token its grammar
        refuses, so a token `pick` did not just return as allowed is checked first (a BackendError)."""
        if token != self._allowed and not self.allows(token):
            raise BackendError("llama_sampler_accept", None, f"the grammar does not allow token {token} here")
        self._allowed = None
        C.llama_sampler_accept(self.ptr, token)


def sampler_accept(chain: SamplerHandle, token: int) -> None:
    """Record a token chosen outside `SamplerHandle.sample` (penalty history)."""
    C.llama_sampler_accept(chain.ptr, token)


# llama-cpp-python's maintained port of llama.cpp's JSON-schema → GBNF converter (pure Python, shipped with
# the binding), re-exported so that the engine reaches the binding through this module only.
from llama_cpp.llama_grammar import INVALID_RULE_CHARS_RE as GRAMMAR_INVALID_CHARS  # noqa: E402,F401
from llama_cpp.llama_grammar import JSON_GBNF as JSON_GBNF  # noqa: E402
from llama_cpp.llama_grammar import RESERVED_NAMES as _GRAMMAR_RESERVED  # noqa: E402
from llama_cpp.llama_grammar import SchemaConverter as SchemaConverter  # noqa: E402

GRAMMAR_RESERVED_NAMES = frozenset(_GRAMMAR_RESERVED)  # rule names the converter keeps for itself


__all__ = ["DRY_BREAKERS", "GRAMMAR_RESERVED_NAMES", "GREEDY_SCAN", "MASK_CHUNK", "GrammarHandle", "SamplerHandle", "sampler_accept"]
