"""Generation pieces that need no engine: sampling settings, stop strings, text assembly (chat templates: chat.py)."""

from __future__ import annotations

import codecs
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import ParameterError
from .scoring import TokenLogprob


@dataclass(frozen=True)
class SamplingParams:
    """llama.cpp's sampler chain settings. temperature 0 means greedy."""

    max_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 40
    top_p: float = 1.0
    min_p: float = 0.0
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int = 0
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N log-probabilities of each generated token (None: none; ≤ 20)
    prompt_logprobs: int | None = None  # the same for every prompt token (scoring; see scoring.py)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token, added to its logit) before sampling; -inf bans it
    # llama-server's other samplers (llama.cpp's own), each at its neutral value by default
    samplers: tuple[str, ...] | None = None  # the chain's order (SAMPLER_NAMES); None: loramux's fixed chain
    typical_p: float = 1.0
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    mirostat: int = 0  # 1: Mirostat, 2: Mirostat 2.0 (temperature, then it alone, as llama-server)
    mirostat_tau: float = 5.0
    mirostat_eta: float = 0.1
    dry_multiplier: float = 0.0
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = 64
    dry_sequence_breakers: tuple[str, ...] = ("\n", ":", "\"", "*")
    # llama-server's code-completion stops (engine/linestops.py)
    n_indent: int = 0  # > 0: stop at a new line indented by fewer spaces/tabs, cutting that line
    t_max_predict_ms: int = -1  # > 0: stop at a new line once this long has passed since the first token

    @property
    def extra_samplers(self) -> dict[str, Any]:
        """The non-neutral settings of llama-server's other samplers (empty: loramux's fixed chain does)."""
        out: dict[str, Any] = {}
        if self.typical_p < 1.0:
            out["typical_p"] = self.typical_p
        if self.xtc_probability > 0 and self.xtc_threshold <= 0.5:
            out.update(xtc_probability=self.xtc_probability, xtc_threshold=self.xtc_threshold)
        if self.mirostat:
            out.update(mirostat=self.mirostat, mirostat_tau=self.mirostat_tau, mirostat_eta=self.mirostat_eta)
        if self.dry_multiplier and self.dry_penalty_last_n:
            out.update(dry_multiplier=self.dry_multiplier, dry_base=self.dry_base,
                       dry_allowed_length=self.dry_allowed_length, dry_penalty_last_n=self.dry_penalty_last_n,
                       dry_sequence_breakers=self.dry_sequence_breakers)
        return out

    @property
    def plain_greedy(self) -> bool:
        """Greedy with no penalties: a sampler chain would only pick the argmax."""
        return (self.temperature <= 0 and self.repeat_penalty == 1.0 and self.samplers is None
                and not self.frequency_penalty and not self.presence_penalty and not self.logit_bias
                and not self.extra_samplers)

    def sampler_args(self) -> dict[str, Any]:
        """The keywords of llama.cpp's sampler chain (`_native.SamplerHandle.chain`)."""
        return {"temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p, "min_p": self.min_p,
                "repeat_penalty": self.repeat_penalty, "repeat_last_n": self.repeat_last_n,
                "frequency_penalty": self.frequency_penalty, "presence_penalty": self.presence_penalty,
                "seed": self.seed, "logit_bias": self.logit_bias, "extra": self.extra_samplers,
                "order": self.samplers if self.samplers is not None or not self.extra_samplers
                else DEFAULT_SAMPLER_ORDER}

    def validate(self) -> SamplingParams:
        problems = []
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= 20):
                problems.append((name, f"must be an integer in [0, 20] or None, got {v!r}"))
        if self.max_tokens < 0:
            problems.append(("max_tokens", "must be ≥ 0"))
        for name in ("temperature", "top_p", "min_p", "repeat_penalty"):
            v = getattr(self, name)
            if not math.isfinite(v) or v < 0:
                problems.append((name, f"must be a finite number ≥ 0, got {v}"))
        if not 0 <= self.top_p <= 1:
            problems.append(("top_p", "must be in [0, 1]"))
        if any(math.isnan(b) or b == math.inf for _, b in self.logit_bias):
            problems.append(("logit_bias", "biases must be numbers (or -inf, which bans the token)"))
        problems += self._llama_problems()
        if any(not isinstance(s, str) or not s for s in self.stop):
            problems.append(("stop", "stop strings must be non-empty strings"))
        if problems:
            raise ParameterError(problems[0][0], problems[0][1])
        return self

    def _llama_problems(self) -> list[tuple[str, str]]:
        """llama-server's sampler settings out of their range."""
        out = []
        if self.samplers is not None and any(n not in SAMPLER_NAMES for n in self.samplers):
            bad = next(n for n in self.samplers if n not in SAMPLER_NAMES)
            out.append(("samplers", f"unknown sampler {bad[:40]!r}: loramux builds {', '.join(SAMPLER_NAMES)}"))
        if self.mirostat not in (0, 1, 2):
            out.append(("mirostat", "must be 0 (off), 1 (Mirostat) or 2 (Mirostat 2.0)"))
        for name in ("typical_p", "xtc_probability", "xtc_threshold", "mirostat_tau", "mirostat_eta",
                     "dry_multiplier", "dry_base"):
            v = getattr(self, name)
            if not math.isfinite(v) or v < 0:
                out.append((name, f"must be a finite number ≥ 0, got {v}"))
        if not 0 <= self.xtc_probability <= 1:
            out.append(("xtc_probability", "must be in [0, 1]"))
        if self.dry_allowed_length < 0 or self.dry_penalty_last_n < 0 or self.n_indent < 0:
            out.append(("dry_allowed_length" if self.dry_allowed_length < 0 else "dry_penalty_last_n"
                        if self.dry_penalty_last_n < 0 else "n_indent", "must be ≥ 0"))
        if not self.dry_sequence_breakers or any(not isinstance(b, str) or not b for b in self.dry_sequence_breakers):
            out.append(("dry_sequence_breakers", "must be a non-empty list of non-empty strings"))
        return out


#: the sampler names a `samplers` order may hold (llama-server's)
SAMPLER_NAMES = ("penalties", "dry", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature", "infill")
#: llama-server's default order (common_params_sampling.samplers), used when another sampler is set without an
#: order; top_n_sigma left out (loramux has no field for it, and at its default it does nothing)
DEFAULT_SAMPLER_ORDER = ("penalties", "dry", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature")


@dataclass
class Completion:
    """The result of a generation."""

    text: str
    tokens: list[int]
    finish_reason: str  # "stop" (EOS or stop string) | "length" | "cancelled"
    prompt_tokens: int
    loras: dict[str, float] = field(default_factory=dict)
    alora: dict[str, bool] = field(default_factory=dict)  # aLoRA name -> invocation found in the prompt
    versions: dict[str, int] = field(default_factory=dict)  # adapter name -> content version it ran on
    # Per-token log-probabilities (engine/scoring.py TokenLogprob) when the request asked for them:
    # `logprobs` of the generated tokens, `prompt_logprobs` of every prompt token (the first has None).
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None

    @property
    def completion_tokens(self) -> int:
        return len(self.tokens)


Tables = tuple[list[dict[str, int]], list[int], list[int], list[int]]


@functools.lru_cache(maxsize=32)
def _automaton(stops: tuple[str, ...]) -> Tables:
    """Goto, depth, failure and output tables of the stop strings (shared, never mutated)."""
    goto: list[dict[str, int]] = [{}]
    depth, terminal = [0], [False]
    for s in stops:
        node = 0
        for ch in s:
            nxt = goto[node].get(ch)
            if nxt is None:
                nxt = len(goto)
                goto[node][ch] = nxt
                goto.append({})
                depth.append(depth[node] + 1)
                terminal.append(False)
            node = nxt
        terminal[node] = True
    fail = [0] * len(goto)
    out = [0] * len(goto)  # length of the longest stop string that ends at this state
    order = list(goto[0].values())
    for v in order:
        out[v] = depth[v] if terminal[v] else 0
    i = 0
    while i < len(order):  # breadth first: a failure link points to a shallower, finished state
        u = order[i]
        i += 1
        for ch, v in goto[u].items():
            f = fail[u]
            while f and ch not in goto[f]:
                f = fail[f]
            fail[v] = goto[f].get(ch, 0)
            out[v] = depth[v] if terminal[v] else out[fail[v]]
            order.append(v)
    return goto, depth, fail, out


class StopMatcher:
    """Aho-Corasick automaton over the stop strings, fed the text once, a chunk at a time.

    Its state is the longest suffix of the text so far that is a prefix of some stop string, so each
    character costs O(1) amortized whatever the number and length of the stop strings: the work is
    linear in the output (`work` counts every transition, failure links included; it never exceeds
    twice the characters fed plus the longest stop string).
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.goto, self.depth, self.fail, self.out = _automaton(tuple(stops))
        self.longest = max((len(s) for s in stops), default=0)
        self.state = 0
        self.work = 0

    @staticmethod
    def prepare(stops: Sequence[str]) -> None:
        """Build (and cache) the tables for these stop strings now, e.g. on a worker thread, so the
        engine thread that admits the request does not pay for it."""
        if stops:
            _automaton(tuple(stops))

    @property
    def held(self) -> int:
        """Characters at the end of the text that could still begin a stop string."""
        return self.depth[self.state]

    def scan(self, text: str, offset: int) -> int | None:
        """Feed `text`, whose first character sits at `offset` in the whole output; return where the
        earliest stop string ending inside it starts, or None."""
        goto, fail, out = self.goto, self.fail, self.out
        node, work, best = self.state, 0, None
        for i, ch in enumerate(text):
            while node and ch not in goto[node]:
                node = fail[node]
                work += 1
            node = goto[node].get(ch, 0)
            work += 1
            if out[node]:
                start = offset + i + 1 - out[node]
                if best is None or start < best:
                    best = start
        self.state = node
        self.work += work
        return best


class TextAssembler:
    """Turns sampled tokens into text chunks: UTF-8 safe, stop strings never leak partially.

    Text that could be the start of a stop string is held back until it is clearly not one. Each
    token's text goes through the stop matcher once (`StopMatcher`), and only the held-back tail,
    shorter than the longest stop string, is kept apart from the text already handed out: the work
    per token does not grow with the output.
    """

    def __init__(self, stop: Sequence[str]) -> None:
        self.stop = tuple(stop)
        self.matcher = StopMatcher(self.stop) if self.stop else None
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._parts: list[str] = []  # text handed out, in chunks
        self._tail = ""  # decoded, not yet handed out: could begin a stop string
        self.emitted = 0  # characters handed out
        self.stopped = False

    @property
    def text(self) -> str:
        """Everything decoded so far (never past a stop string)."""
        return "".join(self._parts) + self._tail

    def feed(self, piece: bytes) -> str:
        """Add a token's bytes; return the new text that is safe to show."""
        if self.stopped:
            return ""
        new = self._dec.decode(piece)
        buf = self._tail + new
        if self.matcher is None:
            return self._take(buf, len(buf))
        hit = self.matcher.scan(new, self.emitted + len(self._tail))
        if hit is not None:
            self.stopped = True
            return self._take(buf[:hit - self.emitted], hit - self.emitted)
        return self._take(buf, max(0, len(buf) - self.matcher.held))

    def flush(self) -> str:
        """At the end: everything not yet shown (a held-back prefix that never became a stop)."""
        buf = self._tail if self.stopped else self._tail + self._dec.decode(b"", final=True)
        return self._take(buf, len(buf))

    def since(self, start: int) -> str:
        """The text from character `start` on (`text[start:]`), reading only the chunks it spans: the cost is
        that of the result, not of the whole output."""
        pieces, pos = [self._tail], self.emitted
        for part in reversed(self._parts):
            if pos <= start:
                break
            pos -= len(part)
            pieces.append(part)
        return "".join(reversed(pieces))[start - pos:]

    def cut(self, upto: int) -> None:
        """End the text at character `upto` (what was handed out past it stays handed out, as a stream sent
        it; the final text is cut)."""
        kept = self.text[:upto]
        self._parts, self._tail, self.emitted, self.stopped = [kept] if kept else [], "", len(kept), True

    def _take(self, buf: str, upto: int) -> str:
        out, self._tail = buf[:upto], buf[upto:]
        if out:
            self._parts.append(out)
            self.emitted += len(out)
        return out


__all__ = ["DEFAULT_SAMPLER_ORDER", "SAMPLER_NAMES", "Completion", "SamplingParams", "StopMatcher", "Tables", "TextAssembler"]
