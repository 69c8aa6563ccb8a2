"""One writer per adapter: the only way its factor tensors change in place.

A `FactorWriter` owns an adapter's staging (the `Mirror` of factor_stage.py, created by the first
write), its content version, one lock and one hop. Its state is the attribute `state`:

    IDLE ──begin──► STAGING ──publish──► PUBLISHED ──begin──► STAGING ...
                       │
                       └──restore──► RESTORED ──begin──► STAGING ...
    IDLE, STAGING, PUBLISHED, RESTORED ──close──► CLOSED (final)

- STAGING: an update is being filled in and checked. `write` (set_factors_multi) stages and
  publishes within one section between decodes; `edit()` stays STAGING for its with-block.
- PUBLISHED: the live tensors hold the last update whole; `version` went up.
- RESTORED: the last update was refused (shape, NaN/Inf, the delta bound, an exception in the
  with-block): nothing reached the live tensors and the mirror was reloaded from them.
- CLOSED: the adapter was unloaded; every later step raises.

Any other step raises `FactorStateError` (errors.py) with the state and the action asked; in
particular a write that finds the writer STAGING (an `edit()` block open) is refused at once.

Why it cannot tear or deadlock:

- One hop (`between`, the engine's `call_between_decodes`): every step that touches tensors runs
  between decodes, on the engine thread or on the caller's with the idle engine held. Writes are
  serialised by it; a whole `write` runs begin → publish inside one such section, so two writes
  never meet in STAGING.
- One lock (`_lock`) guards each transition and the tensors touched with it. It is taken only
  inside a section, held for no wait (no hop, no user code, no other lock): a writer never waits
  for another writer, and `close` (the adapter's unload) cannot free tensors under a publish.
"""

from __future__ import annotations

import contextlib
import enum
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

import numpy as np

from .. import _native as N
from ..errors import FactorError, FactorStateError, LoramuxError
from . import factor_stage
from .factor_stage import (
    MAX_DELTA_GAIN,
    FactorTensors,
    Mirror,
    delta_bound_problems,
    encode,
    total_bytes,
)

T = TypeVar("T")
Factors = Mapping[str, tuple[Any, Any]]


class WriterState(enum.Enum):
    """Where a `FactorWriter` is (see the module docstring for the transitions)."""

    IDLE = "idle"
    STAGING = "staging"
    PUBLISHED = "published"
    RESTORED = "restored"
    CLOSED = "closed"


S = WriterState
# The legal transitions, and nothing else (`FactorWriter._to` enforces them).
TRANSITIONS: dict[WriterState, frozenset[WriterState]] = {
    S.IDLE: frozenset({S.STAGING, S.CLOSED}),
    S.STAGING: frozenset({S.PUBLISHED, S.RESTORED, S.CLOSED}),
    S.PUBLISHED: frozenset({S.STAGING, S.CLOSED}),
    S.RESTORED: frozenset({S.STAGING, S.CLOSED}),
    S.CLOSED: frozenset(),
}
_ACTION = {S.STAGING: "write", S.PUBLISHED: "publish", S.RESTORED: "restore", S.CLOSED: "close"}


def _inline(fn: Callable[[], T]) -> T:
    return fn()


class FactorWriter:
    """Stages, checks and publishes one adapter's factor updates; see the module docstring.

    `factors`: where the adapter's factors live; `alpha`, `dtype`: the adapter's (for the delta
    bound and messages); `between`: runs a function between decodes and returns its result (the
    engine's `call_between_decodes`; inline when the adapter has no engine).
    """

    def __init__(self, name: str, factors: Mapping[str, FactorTensors], alpha: float, dtype: str,
                 between: Callable[[Callable[[], Any]], Any] | None = None) -> None:
        self.name = name
        self.alpha = alpha
        self.dtype = dtype
        self.state = WriterState.IDLE
        self.version = 0  # the adapter's content version: +1 per published update
        self._factors = dict(factors)
        self._between = between or _inline
        self._lock = threading.Lock()
        self._mirror: Mirror | None = None
        self._mirror_current = False  # False after a direct write: the mirror must re-read the tensors
        self._session: object | None = None  # the open edit() block, while STAGING for one
        self._total = total_bytes(self._factors)
        # for the delta bound's fast path (_value_problems): the widest input of any A, and
        # |alpha/r|·r of any B (|alpha|, or the rank when alpha is 0)
        self._widest_in = max((f.a_shape[1] for f in self._factors.values()), default=0)
        self._widest_gain = abs(alpha) if alpha else max((f.a_shape[0] for f in self._factors.values()), default=0)

    # -- the steps callers take --------------------------------------------------------------
    def write(self, factors: Factors, version: int | None = None) -> int:
        """Validate, then write `factors` (name → (A, B)) in place: all of them, or nothing.

        Runs between decodes. `version`: the content version the update becomes (a push promised
        it to the requests behind it); default the next one. Returns the new version. Refused
        input raises FactorError and leaves the writer RESTORED, the tensors as they were.
        """
        return self._between(lambda: self._write_now(factors, version))

    @contextlib.contextmanager
    def edit(self) -> Iterator[dict[str, tuple[np.ndarray, np.ndarray]]]:
        """Writable views of the whole mirror, published on exit (see `LoRAAdapter.edit`)."""
        if self.dtype not in ("F32", "F16"):
            raise FactorError(self.name, f"edit() needs an F32 or F16 adapter, this one is {self.dtype}",
                              problems=["use set_factors_multi(), which converts float32 input to BF16"])
        session = object()
        mirror = self._between(lambda: self._open_edit(session))
        try:
            yield dict(mirror.views)
        except BaseException:
            with contextlib.suppress(LoramuxError):  # unloaded, or the engine closed: nothing left to restore
                self._between(lambda: self._finish_edit(session, restore=True))
            raise
        self._between(lambda: self._finish_edit(session, restore=False))

    def close(self) -> None:
        """The adapter is being unloaded: refuse every later step (idempotent). An update being
        published finishes first; an open edit() block then fails on exit."""
        with self._lock:
            if self.state is not S.CLOSED:
                self._to(S.CLOSED)
            self._mirror = None
            self._session = None

    # -- between decodes ---------------------------------------------------------------------
    def _write_now(self, factors: Factors, version: int | None) -> int:
        with self._lock:
            self._to(S.STAGING)
            try:
                if self._total <= factor_stage.MIRROR_MAX_BYTES:
                    mirror = self._current_mirror()
                    problems, touched = mirror.fill(factors)
                    self._check_and_commit(mirror, touched, problems)
                else:  # large: validated arrays straight to the tensors (a mirror would double the bytes)
                    problems, jobs, floats = encode(self._factors, factors)
                    self._refuse_if(problems or delta_bound_problems(floats, self.alpha))
                    self._mirror_current = False
                    for ptr, arr in jobs:
                        N.tensor_set(ptr, arr)
            except BaseException:
                self._restore(list(self._factors))
                raise
            return self._publish(version)

    def _open_edit(self, session: object) -> Mirror:
        with self._lock:
            self._to(S.STAGING, "edit")
            try:
                mirror = self._current_mirror()
            except BaseException:
                self._to(S.RESTORED)
                raise
            self._session = session
            return mirror

    def _finish_edit(self, session: object, restore: bool) -> None:
        with self._lock:
            action = "restore" if restore else "publish"
            if self.state is not S.STAGING or self._session is not session:
                raise self._illegal(action, "this edit() block is not the one open on the adapter")
            self._session = None
            names = list(self._factors)
            assert self._mirror is not None
            if restore:
                self._restore(names)
                return
            try:
                self._check_and_commit(self._mirror, names, [])
            except BaseException:
                self._restore(names)
                raise
            self._publish(None)

    # -- the pieces (the lock is held) -----------------------------------------------------------
    def _to(self, new: WriterState, action: str | None = None) -> None:
        """Move to `new`, or raise FactorStateError if the transition is not in TRANSITIONS."""
        if new not in TRANSITIONS[self.state]:
            raise self._illegal(action or _ACTION[new])
        self.state = new

    def _illegal(self, action: str, why: str = "") -> FactorStateError:
        state = self.state
        if state is S.CLOSED:
            return FactorStateError(self.name, state.value, action, "the adapter was unloaded",
                                    problems=["load it again (Engine.load_lora) and use the new LoRAAdapter"])
        if state is S.STAGING and action in ("write", "edit"):
            return FactorStateError(self.name, state.value, action, f"cannot {action}: an edit() block of this "
                                    "adapter is open", problems=["finish the with-block before other writes to "
                                                                 "the same adapter"])
        return FactorStateError(self.name, state.value, action,
                                f"cannot {action} while the factor writer is {state.value}" + (f": {why}" if why else ""))

    def _current_mirror(self) -> Mirror:
        """The mirror, holding the live values (created on first use; re-read after a direct write)."""
        if self._mirror is None:
            self._mirror = Mirror(self._factors)
        elif not self._mirror_current:
            self._mirror.reload(list(self._factors))
        self._mirror_current = True
        return self._mirror

    def _check_and_commit(self, mirror: Mirror, touched: list[str], problems: list[str]) -> None:
        """Refuse (FactorError) unless what the mirror holds for `touched` passes; else publish it to the tensors."""
        self._refuse_if(problems or self._value_problems(mirror, touched))
        mirror.commit(touched)

    def _publish(self, version: int | None) -> int:
        self._to(S.PUBLISHED)
        self.version = self.version + 1 if version is None else version
        return self.version

    def _restore(self, names: list[str]) -> None:
        """Nothing reached the tensors: bring the mirror back to their values (when it holds any)."""
        if self._mirror is not None and self._mirror_current:
            self._mirror.reload(names)
        self._to(S.RESTORED)

    def _value_problems(self, mirror: Mirror, touched: list[str]) -> list[str]:
        """NaN/Inf, or a delta that could overflow F32 (the bound a load checks), in what `touched` holds.

        One max |x| over the update decides the common case: if even the largest value times the
        widest input (for A) and times |alpha| or the rank (for B) stays in the bound, every target
        does; only otherwise is each target checked exactly.
        """
        big = mirror.largest(touched)
        if not np.isfinite(big):
            return [f"{n}: factors contain NaN or Inf (after conversion to {self.dtype})"
                    for n in mirror.check(touched)] or [f"factors contain NaN or Inf (after conversion to {self.dtype})"]
        g_a, g_b = big * self._widest_in, big * self._widest_gain
        if g_a <= MAX_DELTA_GAIN and g_b <= MAX_DELTA_GAIN and g_a * g_b <= MAX_DELTA_GAIN:
            return []
        return delta_bound_problems({n: mirror.floats(n) for n in touched}, self.alpha)

    def _refuse_if(self, problems: list[str]) -> None:
        if problems:
            raise FactorError(self.name, "factors refused, nothing written", problems=problems)


__all__ = ["TRANSITIONS", "FactorWriter", "WriterState"]
