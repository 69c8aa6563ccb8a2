"""The engine thread's command queue: work other threads hand it, and the one "between decodes" hop.

Every llama_context belongs to the engine thread (runtime.py). Other threads reach it in three ways:

- `call_async(fn)`: queue `fn` and get its Future at once; commands run in the order queued (the
  server relies on this to order a request's submit against an adapter's removal);
- `call(fn)`: the same, waiting for the result (at once when already on the engine thread);
- `call_between_decodes(fn)`: run `fn` where no decode can be in flight. On the engine thread, or nested
  in another such call: at once. When the engine is idle (nothing queued, no step running) at once on
  the caller's thread with `busy` held, which saves the two thread switches of a hop (0.1–0.2 ms of an
  in-place write); otherwise like `call`.

`busy` is held by the engine thread while it runs commands or a step, and by a caller running work
between decodes, which is recorded so that work it nests (a push's in-place write) runs inline instead
of hopping to the engine it is blocking.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from ..errors import EngineClosedError

T = TypeVar("T")


class CommandQueue:
    """Commands for one engine thread (set `thread` before the first call), and its open/closed state."""

    def __init__(self) -> None:
        self._items: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]] | None] = queue.SimpleQueue()
        self.wake = threading.Event()
        self.busy = threading.Lock()
        self._between_owner: int | None = None
        self.thread: threading.Thread | None = None
        self.closed = False  # set by stop() once the engine thread reaches it, or by the engine
        self.lost: Exception | None = None  # set when the RPC workers holding the model were lost

    def pending(self) -> int:
        """Commands queued and not yet run."""
        return self._items.qsize()

    def _closed_error(self) -> Exception:
        return self.lost or EngineClosedError("the engine is closed")

    def on_thread(self) -> bool:
        """Is the caller the engine thread?"""
        return threading.current_thread() is self.thread

    def call(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the engine thread between decodes and return its result (re-raising its error)."""
        if self.on_thread():
            return fn()
        return self.call_async(fn).result()

    def call_between_decodes(self, fn: Callable[[], T]) -> T:
        """Run `fn` where no decode is in flight (see the module docstring). `fn` must not wait for the engine."""
        me = threading.get_ident()
        if self.on_thread() or self._between_owner == me:
            return fn()
        if self._items.empty() and self.busy.acquire(blocking=False):
            self._between_owner = me
            try:
                if self.closed:
                    raise self._closed_error()
                return fn()
            finally:
                self._between_owner = None
                self.busy.release()
        return self.call(fn)

    def call_async(self, fn: Callable[[], T]) -> Future[T]:
        """Queue `fn` for the engine thread and return its Future at once, without waiting."""
        if self.closed:
            raise self._closed_error()
        fut: Future[T] = Future()
        self._items.put((fn, fut))
        self.wake.set()
        return fut

    def run_pending(self) -> None:
        """Run every queued command (engine thread, `busy` held); the stop mark closes the queue."""
        while True:
            try:
                item = self._items.get_nowait()
            except queue.Empty:
                return
            if item is None:
                self.closed = True
                continue
            fn, fut = item
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except BaseException as e:  # noqa: BLE001 - handed to the caller
                    fut.set_exception(e)

    def drain(self, error: Exception) -> None:
        """Fail every command still queued with `error` (none is left hanging)."""
        while True:
            try:
                item = self._items.get_nowait()
            except queue.Empty:
                return
            if item is not None:
                item[1].set_exception(error)

    def stop(self) -> None:
        """Queue the stop mark: the engine thread closes the queue when it reaches it."""
        self._items.put(None)
        self.wake.set()

    def idle_wait(self, timeout: float) -> None:
        """Sleep until a command arrives or `timeout` seconds pass (the engine thread, with nothing to do)."""
        self.wake.wait(timeout)
        self.wake.clear()


def pass_failure(cmd: Future[Any], fut: Future[Any]) -> None:
    """A command that never ran (the engine closed) fails the Future it was to answer."""
    err = None if cmd.cancelled() else cmd.exception()
    if err is not None and not fut.done():
        with contextlib.suppress(Exception):
            fut.set_exception(err)


__all__ = ["CommandQueue", "pass_failure"]
