"""The engine's figures as typed records: counters since start, slot waits, and the scheduler's load.

They cross from the engine thread to readers on other threads (the server's metrics, `/slots`, tests,
benchmarks) and are read by attribute, so a renamed figure fails where it is read instead of reading as 0.
The engine thread counts into `Counters` (mutable, its own); readers get frozen copies (`EngineStats`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType


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

    @property
    def kv_usage(self) -> float:
        """The fraction of the context's cells that running sequences occupy (0..1)."""
        return self.kv_used / self.kv_total if self.kv_total else 0.0


__all__ = ["Counters", "EngineStats", "SchedulerSnapshot", "SlotWaits"]
