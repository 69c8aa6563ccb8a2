"""The engine's figures as typed records: counters since start, slot waits, and the scheduler's load.

They cross from the engine thread to readers on other threads (the server's metrics, `/slots`, tests,
benchmarks) and are read by attribute, so a renamed figure fails where it is read instead of reading as 0.
The engine thread counts into `Counters` (mutable, its own); readers get frozen copies (`EngineStats`).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType

GAPS_KEPT = 1024  # recent decode gaps the p99 is taken over


@dataclass(frozen=True, slots=True)
class EngineStats:
    """Counters of the serving context since the engine started (a copy: later steps do not change it)."""

    adapter_switches: int = 0  # changes of the adapter set applied to the serving context
    decode_steps: int = 0  # llama_decode calls of the serving context
    prompt_tokens: int = 0  # prompt tokens of admitted requests (reused ones included)
    generated_tokens: int = 0
    prompt_tokens_reused: int = 0  # prefix tokens taken from a slot's cache instead of decoded again
    batch_tokens: int = 0  # tokens sent to llama_decode
    multi_seq_steps: int = 0  # decodes holding tokens of several sequences
    kv_guard_failures: int = 0  # requests the KV guard stopped (their K/V left the cache's range)
    bank_decodes: int = 0  # decodes through the bank's masks (the others had one adapter set for all tokens)
    kv_clears: int = 0  # times the KV data was zeroed after a failed request may have left bad values


@dataclass(slots=True)
class Counters:
    """The engine thread's running counts; the same fields as `EngineStats`, which `frozen()` copies into."""

    adapter_switches: int = 0
    decode_steps: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prompt_tokens_reused: int = 0
    batch_tokens: int = 0
    multi_seq_steps: int = 0
    kv_guard_failures: int = 0
    bank_decodes: int = 0
    kv_clears: int = 0

    def frozen(self) -> EngineStats:
        """A copy for another thread (each field read once: values may be a step apart, never torn)."""
        return EngineStats(**{f.name: getattr(self, f.name) for f in fields(self)})


@dataclass(frozen=True, slots=True)
class SlotWaits:
    """Seconds that recent banked requests waited for bank slots (all 0 when none waited)."""

    p50_s: float = 0.0
    p99_s: float = 0.0
    max_s: float = 0.0
    max_steps: int = 0  # most decode steps one of them waited (bounded: docs/scaling.md, "Slot waits")


@dataclass(frozen=True, slots=True)
class DecodeGaps:
    """Wall time between the end of one decode of the serving context and the start of the next while
    sequences stayed running: what commands (adapter loads, evictions), admissions (slot writes) and sampling
    add between steps. Idle time (nothing running) never counts."""

    p50_s: float = 0.0  # over the recent GAPS_KEPT gaps
    p99_s: float = 0.0
    max_s: float = 0.0  # since the engine started
    count: int = 0  # gaps measured since start


class GapClock:
    """Measures `DecodeGaps` on the engine thread: `decoding()` before a decode, `decoded(running)` after."""

    def __init__(self) -> None:
        self._last: float | None = None  # end of the last decode that left sequences running
        self._recent: deque[float] = deque(maxlen=GAPS_KEPT)
        self._max, self._count = 0.0, 0

    def decoding(self) -> None:
        if self._last is not None:
            gap = time.perf_counter() - self._last
            self._recent.append(gap)
            self._max = max(self._max, gap)
            self._count += 1
        self._last = None

    def decoded(self, running: bool) -> None:
        self._last = time.perf_counter() if running else None

    def frozen(self) -> DecodeGaps:
        """A copy for another thread."""
        xs = sorted(list(self._recent))
        if not xs:
            return DecodeGaps(max_s=self._max, count=self._count)
        return DecodeGaps(xs[len(xs) // 2], xs[min(len(xs) - 1, int(0.99 * len(xs)))], self._max, self._count)


def _no_counts() -> Mapping[str, int]:
    return MappingProxyType({})


@dataclass(frozen=True, slots=True)
class SchedulerSnapshot:
    """The scheduler's load at one moment, for metrics and `/slots`; safe to read from any thread."""

    waiting: int = 0  # requests queued, not yet holding a sequence slot
    running: int = 0  # requests holding a sequence slot
    kv_used: int = 0  # KV cells that running sequences occupy
    kv_total: int = 0  # the serving context's cells
    running_adapters: Mapping[str, int] = field(default_factory=_no_counts)  # adapter name -> running requests
    waiting_adapters: Mapping[str, int] = field(default_factory=_no_counts)  # adapter name -> queued requests
    slot_waits: SlotWaits = SlotWaits()
    counters: EngineStats = EngineStats()
    kv_guarded_decodes: int = 0  # decodes run with the KV guard
    decode_gaps: DecodeGaps = DecodeGaps()

    @property
    def kv_usage(self) -> float:
        """The fraction of the context's cells that running sequences occupy (0..1)."""
        return self.kv_used / self.kv_total if self.kv_total else 0.0


__all__ = ["GAPS_KEPT", "Counters", "DecodeGaps", "EngineStats", "GapClock", "SchedulerSnapshot", "SlotWaits"]
