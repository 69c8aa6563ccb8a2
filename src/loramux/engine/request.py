"""A generation request: its immutable input (`RequestInput`) and its state on the engine thread (`Request`).

The scheduler (scheduler.py) owns a request's state once submitted; other threads read only its
`events` and set `cancelled`.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .. import _native as N
from .grammar import ActiveGrammar
from .linestops import LineStops
from .phases import Phase
from .sampling import SamplingParams, TextAssembler
from .scoring import Scoring

log = logging.getLogger("loramux")

_ids = itertools.count(1)


@dataclass(frozen=True, slots=True)
class RequestInput:
    """What a generation was submitted with; it never changes (the engine thread's state is on `Request`).

    `phases` is fixed as a list; admission records each phase's bank slots on the phase (`Phase.slot_scales`).
    """

    prompt: list[int]  # not modified (a list: slot caches compare token lists)
    params: SamplingParams
    phases: list[Phase]
    alora: Mapping[str, bool] = field(default_factory=dict)
    on_event: Callable[[str, Any], None] | None = None
    arrived: float = field(default_factory=time.monotonic)
    share: Request | None = None  # n > 1: a sibling on the same prompt whose prompt KV this one shares
    shown: frozenset[int] = frozenset()  # control tokens whose text goes into the output (a tool format's tags)
    stop_tokens: frozenset[int] = frozenset()  # tokens that end the output like an end-of-generation token
    party: object | None = None  # the request of several sequences this one is a sequence of (fairness.py)


@dataclass
class Request:
    """One generation in flight: its input, its event channel and its state on the engine thread.
    Events go to `events`: ("text", str), ("done", Completion), ("error", exc)."""

    input: RequestInput
    id: int = field(default_factory=lambda: next(_ids))
    events: queue.SimpleQueue[tuple[str, Any]] = field(default_factory=queue.SimpleQueue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    # state (engine thread only)
    seq: int | None = None
    n_past: int = 0
    pending: int | None = None  # sampled token not yet decoded
    generated: list[int] = field(default_factory=list)
    sampler: N.SamplerHandle | None = None
    grammar: ActiveGrammar | None = None  # constrained output (grammar.py); checked lazily per token
    slots: list[int] = field(default_factory=list)  # bank slots held while running
    text: TextAssembler | None = None
    lines: LineStops | None = None  # n_indent / t_max_predict_ms (linestops.py)
    first_token_at: float | None = None
    cached: int = 0  # prompt tokens taken from a slot's KV cache instead of decoded (usage's cached_tokens)
    blocked_step: int | None = None  # decode step at which it first waited for bank slots
    admitted_step: int | None = None  # decode step at which it took its sequence (and its bank slots)
    blocked_at: float | None = None
    scoring: Scoring | None = None  # logprobs wanted (prompt and/or generated tokens; see scoring.py)

    @property
    def prompt(self) -> list[int]:
        return self.input.prompt

    @property
    def params(self) -> SamplingParams:
        return self.input.params

    @property
    def phases(self) -> list[Phase]:
        return self.input.phases

    @property
    def party(self) -> object | None:
        return self.input.party

    @property
    def arrived(self) -> float:
        return self.input.arrived

    def phase_at(self, pos: int) -> Phase:
        cur = self.phases[0]
        for ph in self.phases:
            if pos >= ph.start:
                cur = ph
        return cur

    @property
    def cache_key(self) -> tuple[Any, ...]:
        return tuple((ph.key, ph.start) for ph in self.phases)

    def emit(self, kind: str, value: Any) -> None:
        self.events.put((kind, value))
        if self.input.on_event is not None:
            try:
                self.input.on_event(kind, value)
            except Exception:  # noqa: BLE001 - a broken listener ends its own request, nothing else
                log.exception("a request's event callback failed; cancelling that request")
                self.cancelled.set()


__all__ = ["Request", "RequestInput"]
