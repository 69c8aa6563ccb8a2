"""Adapter loads off the engine thread: the one way a file becomes a `LoRAAdapter`, and the count of loads
running that `Engine.close` waits for.

A load runs on the thread that asks for it (an explicit `Engine.load_lora`, or the request naming a cold
adapter: residency.py): parse and checks, llama.cpp's load, the tensor discovery, and the adapter's warm
slot blocks and KV-guard gains from the factors just parsed (the live ones are the same bytes, so nothing
reads them back on the engine thread later). The engine thread only publishes the result.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ..errors import AdapterError, EngineClosedError
from .adapters import CheckedAdapter, LoRAAdapter
from .bank import SlotBank
from .kv_guard import KvGuard
from .model import Model


def build_adapter(model: Model, path: Path, name: str, source: str, between: Callable[[Callable[[], Any]], Any],
                  bank: SlotBank | None, guard: KvGuard | None) -> LoRAAdapter:
    """Parse, check and load `path` into llama.cpp as `name`, unpublished, warm from the parse (any thread).
    Its AdapterError names the adapter."""
    try:
        checked = CheckedAdapter(model, path)
        try:
            adapter = LoRAAdapter(model, checked, name, between, source=source)
        finally:
            checked.close()
    except AdapterError as e:
        e.name = name
        raise
    try:
        if bank is not None:
            with contextlib.suppress(AdapterError):  # cannot go into a slot: its slot write says why, later
                bank.warm_from_file(adapter, checked.factors)
        if guard is not None:
            guard.gains(adapter, checked.factors)
    except BaseException:
        adapter.close()  # never published: nothing else would free it
        raise
    return adapter


class Loads:
    """Loads running on other threads: `running()` around each, `close()` refuses new ones and waits for these
    (the model must outlive every load, and a load's adapter must be published or freed before it goes)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._n, self._closing = 0, False

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        with self._cond:
            if self._closing:
                raise EngineClosedError("the engine was closed")
            self._n += 1
        try:
            yield
        finally:
            with self._cond:
                self._n -= 1
                self._cond.notify_all()

    def close(self, timeout: float = 120.0) -> None:
        with self._cond:
            self._closing = True
            self._cond.wait_for(lambda: self._n == 0, timeout=timeout)


__all__ = ["Loads", "build_adapter"]
