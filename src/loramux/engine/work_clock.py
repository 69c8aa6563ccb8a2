"""A clock for per-request CPU budgets: this thread's CPU time, less what Python's garbage collector took.

The grammar budgets (grammar.py) charge a request for the engine thread's CPU time in its grammar's
checks and passes: CPU time, so that waiting for the GIL or a core is not charged. A garbage collection
that happens to start inside those checks is not the grammar's work either, and in a process with a large
heap one full collection takes tenths of a second, more than a whole token's budget (grammar_token_seconds,
0.2 s). The collector reports each collection's start and stop to `gc.callbacks` on the thread that runs
it; the CPU time between the two is subtracted here, per thread.
"""

from __future__ import annotations

import gc
import threading
import time
from typing import Any


class _GcTime(threading.local):
    spent = 0.0  # this thread's CPU seconds in finished collections
    started: float | None = None


_gc = _GcTime()


def _on_gc(phase: str, _info: dict[str, Any]) -> None:
    if phase == "start":
        _gc.started = time.thread_time()
    elif _gc.started is not None:
        _gc.spent += time.thread_time() - _gc.started
        _gc.started = None


gc.callbacks.append(_on_gc)


def work_time() -> float:
    """This thread's CPU seconds outside garbage collection (a monotonic clock for budgets, per thread)."""
    return time.thread_time() - _gc.spent


__all__ = ["work_time"]
