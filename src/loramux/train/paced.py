"""Training beside serving: the engine as a training job sees it, with a bounded slice of the engine thread.

The engine thread runs serving steps and every other command one after another, so a training
forward handed to it whole would stall every stream for its whole length. Here a training loss is
computed on a context of the job's own (made and used on the engine thread) in chunks of at most
`chunk` tokens, one chunk per engine command: serving steps come in between, and no step waits for
more than one chunk's forward. While the scheduler has requests, the job also waits after each
chunk so that its forwards take at most `share` of the engine thread's time: after a chunk of t
seconds it waits t·(1 − share)/share. With no request in the engine it runs at full speed.
`cancel` is checked before every chunk and during every wait: a cancelled job stops within one
chunk (a TrainingError raised inside the step; the caller knows it was a cancel by its own event).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

from ..engine.model import Context, ContextOptions
from ..errors import TrainingError

DEFAULT_SHARE = 0.25
DEFAULT_CHUNK = 16  # tokens per engine command


class PacedEngine:
    """An engine wrapper for `ZOTrainer`: losses in chunks on the job's own context, paced to `share`."""

    def __init__(self, engine: Any, cancel: threading.Event, share: float = DEFAULT_SHARE,
                 chunk: int = DEFAULT_CHUNK) -> None:
        if not 0.0 < share <= 1.0:
            raise ValueError(f"share must be in (0, 1], got {share}")
        self.engine = engine
        self.cancel = cancel
        self.share = share
        self.chunk = chunk
        self.forward_s = 0.0  # engine time the job's forwards took
        self.waited_s = 0.0  # time it stood back for serving
        self._ctx: Context | None = None

    @property
    def model(self) -> Any:
        return self.engine.model

    def load_lora(self, *args: Any, **kwargs: Any) -> Any:
        return self.engine.load_lora(*args, **kwargs)

    def check(self) -> None:
        """Raise TrainingError once the job was cancelled."""
        if self.cancel.is_set():
            raise TrainingError("the job was cancelled")

    def _context(self) -> Context:  # engine thread
        if self._ctx is None:
            self._ctx = Context(self.engine.model, ContextOptions(
                n_ctx=self.engine.n_ctx, n_batch=self.chunk, n_ubatch=self.chunk, n_seq_max=1,
                n_threads=self.engine.n_threads))
        return self._ctx

    def loss_sum(self, texts: Sequence[Sequence[int]], *, loras: dict[str, float] | None = None,
                 masks: Sequence[Sequence[bool]] | None = None, **_: Any) -> tuple[float, int]:
        """(sum of token NLLs, tokens scored) of token lists under `loras` (no control vector), like
        Engine.loss_sum, `chunk` tokens per engine command."""
        adapters = [(self.engine.adapter(n), s) for n, s in (loras or {}).items()]
        total, count = 0.0, 0
        for i, tokens in enumerate(texts):
            mask = None if masks is None else masks[i]

            def start(tokens: Sequence[int] = tokens) -> None:
                ctx = self._context()
                ctx.handle.set_adapters([a.handle for a, _ in adapters], [s for _, s in adapters])
                ctx.clear(0)
            self.engine.call(start)
            for at in range(0, len(tokens), self.chunk):
                self.check()
                s, c, dt = self.engine.call(lambda at=at, tokens=tokens, mask=mask: _timed(
                    lambda: self._context().nll_chunk(0, tokens, at, mask)))
                self._pace(dt)
                total += s
                count += c
        return total, count

    def _pace(self, dt: float) -> None:
        self.forward_s += dt
        if self.share < 1.0 and self.engine.scheduler.has_work():
            wait = dt * (1.0 - self.share) / self.share
            self.waited_s += wait
            if self.cancel.wait(wait):
                raise TrainingError("the job was cancelled")

    def close(self) -> None:
        """Free the job's context (on the engine thread). Idempotent."""
        ctx, self._ctx = self._ctx, None
        if ctx is not None:
            self.engine.call(ctx.close)


def _timed(fn: Any) -> tuple[float, int, float]:
    """fn()'s (sum, count) and the seconds it took (on the engine thread: its queueing not counted)."""
    t0 = time.perf_counter()
    s, c = fn()
    return s, c, time.perf_counter() - t0


__all__ = ["DEFAULT_CHUNK", "DEFAULT_SHARE", "PacedEngine"]
