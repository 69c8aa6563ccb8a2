"""Adapter versions that requests can rely on: pushes land only once the requests before them are done.

An adapter's content version (`LoRAAdapter.version`) goes up by one with every write. A *push*
(`Engine.push_factors`) replaces factors so that no request ever sees two versions:

- a request is pinned, when it is submitted, to the version it will run on: the adapter's current
  version, or the version of the last push still waiting for it (`PushGate.target`);
- a push lands at a step boundary (engine thread, between decodes) once no request pinned to an
  earlier version of that adapter is waiting or running; until then it waits, and requests submitted
  after it wait with it (the scheduler holds a request whose pinned version is not yet live);
- so a request that started on version v finishes on v, and the next one runs on the pushed factors.

A push that must wait is validated at once, on the caller's thread (shapes, finite values, the delta
bound a load checks), so the version promised to the requests behind it cannot be refused later;
at most `MAX_PENDING` pushes wait at a time. Only the engine thread touches a `PushGate`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import AdapterVersionError, FactorError, LoramuxError, ParameterError
from .adapters import LoRAAdapter
from .factor_stage import as_float, delta_bound_problems
from .registry import AdapterSet

log = logging.getLogger("loramux")
MAX_PENDING = 8  # pushes waiting for their adapters' earlier requests, over all adapters

Factors = Mapping[str, tuple[Any, Any]]


@dataclass
class PendingPush:
    """A validated push waiting for the requests pinned to earlier versions of its adapter."""

    adapter: LoRAAdapter
    factors: Factors
    target: int  # the version it becomes
    future: Future[int] = field(default_factory=Future)


def check_factors(adapter: LoRAAdapter, factors: Factors) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Every factor pair as float32, checked like a load: known target, shapes, finite, the delta bound.

    Raises FactorError listing every problem; runs on any thread (it reads no live tensor).
    """
    known = adapter.factor_tensors()
    problems: list[str] = []
    out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for name, pair in factors.items():
        f = known.get(name)
        if f is None:
            problems.append(f"{name}: not a factor of this adapter (see factor_names())")
            continue
        try:
            a, b = (as_float(x) for x in pair)
        except (TypeError, ValueError) as e:
            problems.append(f"{name}: {e}")
            continue
        if a.shape != f.a_shape or b.shape != f.b_shape:
            problems.append(f"{name}: got A{a.shape} B{b.shape}, expected A{f.a_shape} B{f.b_shape} "
                            f"(rank and targets are fixed at load)")
        else:  # NaN and Inf: refused by the delta bound below
            out[name] = (a, b)
    if not problems:
        problems = delta_bound_problems(out, adapter.alpha)
    if problems:
        raise FactorError(adapter.name, "factors refused, nothing written", problems=problems[:8])
    return out


def request_versions(sets: list[AdapterSet]) -> dict[str, int]:
    """name → pinned version of every adapter in `sets` (a request's phases)."""
    out: dict[str, int] = {}
    for s in sets:
        out.update(s.versions)
    return out


class PushGate:
    """The pushes waiting for their adapters to drain, and the versions new requests are pinned to."""

    def __init__(self) -> None:
        self.pending: list[PendingPush] = []

    def target(self, adapter: LoRAAdapter) -> int:
        """The version a request submitted now runs on: the last waiting push's, or the live one."""
        for p in reversed(self.pending):
            if p.adapter is adapter:
                return p.target
        return adapter.version

    def pin(self, aset: AdapterSet) -> AdapterSet:
        """`aset` keyed by the versions its request will run on (see `target`)."""
        if not self.pending:
            return aset
        return aset.at_versions({a.uid: self.target(a) for a, _ in aset.items})

    def push(self, adapter: LoRAAdapter, factors: Factors, scheduler: Any, checked: bool) -> Future[int]:
        """Land the push now if nothing runs on an earlier version of `adapter`, else queue it (engine thread).

        `checked`: the factors passed `check_factors` already (a push that has to wait must have).
        """
        p = PendingPush(adapter, factors, self.target(adapter) + 1)
        if not any(q.adapter is adapter for q in self.pending) and not _uses_below(scheduler, adapter, p.target):
            self._land(p, scheduler)
            return p.future
        if not checked:
            raise _MustCheck()
        if len(self.pending) >= MAX_PENDING:
            raise FactorError(adapter.name, f"{MAX_PENDING} pushes already wait for their adapters' requests",
                              problems=["retry once the earlier pushes landed (each push's response says when)"])
        self.pending.append(p)
        return p.future

    def service(self, scheduler: Any) -> None:
        """Land every waiting push whose adapter has no request left on an earlier version (engine thread)."""
        for p in list(self.pending):
            first = next(q for q in self.pending if q.adapter is p.adapter)
            if first is p and not _uses_below(scheduler, p.adapter, p.target):
                self.pending.remove(p)
                self._land(p, scheduler)

    def _land(self, p: PendingPush, scheduler: Any) -> None:
        try:
            # on the engine thread: written at once, as the version promised to the requests behind it
            p.adapter.writer.write(p.factors, version=p.target)
        except LoramuxError as e:
            self._fail_behind(p, scheduler, e)
            p.future.set_exception(e)
            return
        p.future.set_result(p.target)

    def _fail_behind(self, p: PendingPush, scheduler: Any, error: LoramuxError) -> None:
        """A push that could not land (its adapter was unloaded meanwhile): the pushes and requests
        waiting for versions of it from this one on fail with its error; nothing else changes."""
        for q in [q for q in self.pending if q.adapter is p.adapter]:
            self.pending.remove(q)
            q.future.set_exception(error)
        scheduler.fail_waiting(lambda r: _pinned_above(r, p.adapter, p.adapter.version), error)


class _MustCheck(Exception):
    """The push has to wait: the caller validates it first and pushes again (see Engine.push_factors)."""


def _uses_below(scheduler: Any, adapter: LoRAAdapter, version: int) -> bool:
    """Is a request pinned to a version of `adapter` below `version` waiting or running?"""
    for r in scheduler.waiting + scheduler.running:
        for ph in r.phases:
            for (a, _), (_, v, _) in zip(ph.adapters.items, ph.adapters.key):
                if a is adapter and v < version:
                    return True
    return False


def _pinned_above(r: Any, adapter: LoRAAdapter, version: int) -> bool:
    return any(a is adapter and v > version for ph in r.phases
               for (a, _), (_, v, _) in zip(ph.adapters.items, ph.adapters.key))


def must_check(e: BaseException) -> bool:
    """Whether `e` says the push has to wait and so must be validated first."""
    return isinstance(e, _MustCheck)


def check_versions(asked: Mapping[str, int] | None, runs_on: Mapping[str, int]) -> None:
    """Refuse a request for an adapter version other than the one it would run on."""
    for name, v in (asked or {}).items():
        if name not in runs_on:
            raise ParameterError("model", f"a version of {name!r} was asked for, but the request does not use it")
        if runs_on[name] != v:
            raise AdapterVersionError(name, v, runs_on[name])


__all__ = ["MAX_PENDING", "PendingPush", "PushGate", "check_factors", "check_versions", "must_check", "request_versions"]
