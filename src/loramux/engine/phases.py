"""Phases: the stretches of a sequence computed under one adapter set, and the aLoRA rule that makes them.

An aLoRA adapter applies only from its invocation sequence on, so a request on it has two phases:
the prefix without it and the rest with it. Every other request has one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from .control import ControlSetting
from .registry import AdapterSet


@dataclass
class Phase:
    """A stretch of the sequence computed under one adapter set (aLoRA: prefix without, rest with)."""

    adapters: AdapterSet
    cvec: Any  # control-vector setting with .key and .apply(ctx_handle); None = none
    start: int  # first position of the phase
    banked: bool = False  # served through the slot bank (per-token masks); the bank decides at admission
    slot_scales: list[tuple[int, float]] = field(default_factory=list)  # (slot, request scale) once admitted

    @property
    def key(self) -> tuple[Any, ...]:
        """What the KV computed in this phase depends on: adapter identities, versions, scales, cvec."""
        return (self.adapters.key, getattr(self.cvec, "key", None))

    @property
    def group_key(self) -> tuple[Any, ...]:
        """Requests with equal group keys share a decode: every banked phase shares one (masks differ)."""
        return ("bank", getattr(self.cvec, "key", None)) if self.banked else self.key


class BatchEntry(NamedTuple):
    """A run of one sequence's tokens in a filled batch, as the scheduler hands it to the bank (masks) and
    the KV guard (which run a bad write came from). Entries are in batch order, as the batch was filled."""

    n_tokens: int
    slot_scales: Sequence[tuple[int, float]]  # (bank slot, mask value) of the phase these tokens run under


def alora_phases(aset: AdapterSet, cv: ControlSetting | None, tokens: list[int]) -> tuple[list[Phase], dict[str, bool]]:
    """aLoRA rule: an adapter with invocation tokens applies from the last occurrence of its sequence on."""
    aloras = aset.aloras
    if not aloras:
        return [Phase(aset, cv, 0)], {}
    found: dict[str, bool] = {}
    starts = []
    for a in aloras:
        pos = _last_occurrence(tokens, list(a.invocation_tokens))
        found[a.name] = pos is not None
        if pos is not None:
            starts.append(pos)
    base = aset.without_alora()
    active = AdapterSet(tuple((a, s) for a, s in aset.items if not a.is_alora or found[a.name]))
    if not starts:
        return [Phase(base, cv, 0)], found
    start = min(starts)  # several aLoRAs: all switch on at the earliest invocation (documented)
    if start == 0:
        return [Phase(active, cv, 0)], found
    return [Phase(base, cv, 0), Phase(active, cv, start)], found


def _last_occurrence(seq: list[int], sub: list[int]) -> int | None:
    n = len(sub)
    for i in range(len(seq) - n, -1, -1):
        if seq[i:i + n] == sub:
            return i
    return None


__all__ = ["BatchEntry", "Phase", "alora_phases"]
