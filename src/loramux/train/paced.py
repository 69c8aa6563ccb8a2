"""Training beside serving: the engine as a training job sees it, with a bounded share of the engine thread.

The engine thread runs serving steps and every other command one after another. A training loss is
handed to it one text at a time (one forward per command, so serving steps come in between), and
while the scheduler has requests the job waits after each forward so that its forwards take at most
`share` of the engine thread's time: after a forward of t seconds it waits t·(1 − share)/share.
With no request in the engine it runs at full speed. `cancel` is checked before every forward and
during every wait: a cancelled job stops within one forward (a TrainingError, raised inside the
step; the caller knows it was a cancel by its own event).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

from ..errors import TrainingError

DEFAULT_SHARE = 0.25


class PacedEngine:
    """An engine wrapper for `ZOTrainer`: losses one text per engine command, paced to `share`."""

    def __init__(self, engine: Any, cancel: threading.Event, share: float = DEFAULT_SHARE) -> None:
        if not 0.0 < share <= 1.0:
            raise ValueError(f"share must be in (0, 1], got {share}")
        self.engine = engine
        self.cancel = cancel
        self.share = share
        self.forward_s = 0.0  # engine time the job's forwards took
        self.waited_s = 0.0  # time it stood back for serving

    @property
    def model(self) -> Any:
        return self.engine.model

    def load_lora(self, *args: Any, **kwargs: Any) -> Any:
        return self.engine.load_lora(*args, **kwargs)

    def check(self) -> None:
        """Raise TrainingError once the job was cancelled."""
        if self.cancel.is_set():
            raise TrainingError("the job was cancelled")

    def loss_sum(self, texts: Sequence[Any], *, loras: Any = None, masks: Sequence[Sequence[bool]] | None = None,
                 **kwargs: Any) -> tuple[float, int]:
        """(sum of token NLLs, tokens scored), like Engine.loss_sum, one text per engine command."""
        total, count = 0.0, 0
        for i, text in enumerate(texts):
            self.check()
            t0 = time.perf_counter()
            s, c = self.engine.loss_sum([text], loras=loras, masks=None if masks is None else [masks[i]], **kwargs)
            dt = time.perf_counter() - t0
            self.forward_s += dt
            total += s
            count += c
            if self.share < 1.0 and self.engine.scheduler.has_work():
                wait = dt * (1.0 - self.share) / self.share
                self.waited_s += wait
                if self.cancel.wait(wait):
                    raise TrainingError("the job was cancelled")
        return total, count


__all__ = ["DEFAULT_SHARE", "PacedEngine"]
