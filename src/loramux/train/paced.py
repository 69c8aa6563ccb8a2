"""Training beside serving: the engine as a training job sees it, with a bounded slice of the engine thread.

The engine thread runs serving steps and every other command one after another, so a training
forward handed to it whole would stall every stream for its whole length. Here a training loss is
computed on a context of the job's own (made and used on the engine thread) in small pieces, one
piece per engine command, so that serving steps come in between. Three rules bound what a stream
can lose to the job (docs/train.md, "Training beside serving"):

- **A piece's cost is bounded, not its token count.** A token whose next-token logits are scored
  costs the output projection too (for Gemma 3 270M, vocabulary × width is 1.7× the whole body's
  weights), so a piece holds at most `chunk` *cost units*: an unscored token is one unit, a scored
  one 1 + `head_cost` (the output projection over the body's weights, from the model's shapes). A
  piece holds at least one token. With the default 3 units, a piece's forward is about an eighth of
  a step of 8 streams, whose 8 tokens all need logits.
- **At most `share` of the engine's time.** After a piece of t seconds the job waits t·(1 − share)/share
  while requests are served before it queues the next. With no request in the engine it runs at full speed.
- **At most one piece between two serving steps.** The engine starts its step as soon as it finds no
  command queued, right after the piece; the next piece comes after that wait, so after the step (for
  share ≤ 0.5 the wait is at least the piece's own time). With 8 streams a piece is an eighth of a step, so
  this rule binds before the share does: the job takes about one piece per step,
  about 10 % of the engine (8–12 % measured).

The log-softmax over the vocabulary happens on the job's thread, not the engine thread (the engine
thread only copies the scored logit rows out). The job's thread itself runs at the lowest CPU
priority (`nice` 19 for its own thread id), so its numpy work yields the cores to the decoding threads.
`cancel` is checked before every piece and during every wait: a cancelled job stops within one
piece (a TrainingError raised inside the step; the caller knows it was a cancel by its own event).
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..engine.model import Context, ContextOptions
from ..errors import TrainingError

DEFAULT_SHARE = 0.25
DEFAULT_CHUNK = 3  # cost units per engine command (an unscored token is one unit)


def lower_priority() -> bool:
    """Put the calling thread at the lowest CPU priority (nice 19, this thread only); False where the
    platform has no per-thread priorities. The job's numpy work then yields the cores to decoding."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):
        return False
    return True


def head_cost(model: Any) -> float:
    """The extra cost of a token whose logits are scored, in units of an unscored token's forward:
    the output projection's weights (vocabulary × width) over the body's (every other matrix)."""
    shapes: dict[str, tuple[int, ...]] = model.tensor_shapes
    head = model.n_vocab * model.n_embd
    body = sum(math.prod(s) for n, s in shapes.items() if len(s) >= 2 and not n.startswith(("token_embd", "output.")))
    return head / body if body else 1.0


def pieces(n: int, want: Sequence[bool], budget: float, head: float) -> list[tuple[int, int]]:
    """Split tokens [0, n) into (start, end) pieces of at most `budget` cost units each (at least one
    token each): token i costs 1, plus `head` when want[i] (its logits are scored)."""
    out, start, cost = [], 0, 0.0
    for i in range(n):
        c = 1.0 + (head if want[i] else 0.0)
        if i > start and cost + c > budget:
            out.append((start, i))
            start, cost = i, 0.0
        cost += c
    if start < n:
        out.append((start, n))
    return out


class PacedEngine:
    """An engine wrapper for `ZOTrainer`: losses in pieces on the job's own context, paced to `share`."""

    def __init__(self, engine: Any, cancel: threading.Event, share: float = DEFAULT_SHARE,
                 chunk: float = DEFAULT_CHUNK) -> None:
        if not 0.0 < share <= 1.0:
            raise ValueError(f"share must be in (0, 1], got {share}")
        if chunk < 1:
            raise ValueError(f"chunk must be at least 1 cost unit, got {chunk}")
        self.engine = engine
        self.cancel = cancel
        self.share = share
        self.chunk = chunk
        self.forward_s = 0.0  # engine time the job's forwards took
        self.waited_s = 0.0  # time it stood back for serving
        self.pieces = 0
        self._ctx: Context | None = None
        self._head: float | None = None

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
            n = max(1, int(self.chunk))
            self._ctx = Context(self.engine.model, ContextOptions(
                n_ctx=self.engine.n_ctx, n_batch=n, n_ubatch=n, n_seq_max=1, n_threads=self.engine.n_threads))
        return self._ctx

    def loss_sum(self, texts: Sequence[Sequence[int]], *, loras: dict[str, float] | None = None,
                 masks: Sequence[Sequence[bool]] | None = None, **_: Any) -> tuple[float, int]:
        """(sum of token NLLs, tokens scored) of token lists under `loras` (no control vector), like
        Engine.loss_sum, one cost-bounded piece per engine command."""
        if self._head is None:
            self._head = head_cost(self.engine.model)
        adapters = [(self.engine.adapter(n), s) for n, s in (loras or {}).items()]
        total, count = 0.0, 0
        for i, tokens in enumerate(texts):
            mask = None if masks is None else masks[i]
            n = len(tokens)
            # row j predicts token j + 1: only rows predicting a scored token need logits
            want = [j + 1 < n and (mask is None or bool(mask[j + 1])) for j in range(n)]
            for k, (a, b) in enumerate(pieces(n, want, self.chunk, self._head)):
                self.check()
                rows, dt = self.engine.call(lambda a=a, b=b, k=k, tokens=tokens, want=want: self._piece(
                    tokens, a, b, want, adapters if k == 0 else None))
                self._pace(dt)
                for j, row in rows:  # the log-softmax here, on the job's thread (as Context.nll_chunk does it)
                    r = row.astype(np.float64)
                    m = r.max()
                    total += float(m + np.log(np.exp(r - m).sum()) - r[tokens[j + 1]])
                    count += 1
        return total, count

    def _piece(self, tokens: Sequence[int], a: int, b: int, want: Sequence[bool],
               adapters: list[tuple[Any, float]] | None) -> tuple[list[tuple[int, np.ndarray]], float]:
        """Engine thread: decode tokens[a:b] (a new sequence when `adapters` are given) and copy out the
        scored rows' logits; returns them with the seconds it took."""
        t0 = time.perf_counter()
        ctx = self._context()
        if adapters is not None:
            ctx.handle.set_adapters([x.handle for x, _ in adapters], [s for _, s in adapters])
            ctx.clear(0)
        ctx.batch.clear()
        ctx.batch.add(tokens[a:b], a, 0, want[a:b])
        ctx.handle.decode(ctx.batch)
        rows = [(a + j, ctx.handle.logits_row(j)) for j in range(b - a) if want[a + j]]  # copies
        return rows, time.perf_counter() - t0

    def _pace(self, dt: float) -> None:
        """Stand back after a piece of `dt` seconds, for the share. The engine starts a serving step as soon
        as it finds no command queued, which it checks right after the piece; the job queues its next piece
        only after this wait (≥ dt for share ≤ 0.5), so that piece runs after a serving step. (Waiting on the
        scheduler's step count instead was measured worse: polling it every few ms made the job's thread
        contend for the interpreter lock with the engine thread, and the serving steps' p99 grew.)"""
        self.forward_s += dt
        self.pieces += 1
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


__all__ = ["DEFAULT_CHUNK", "DEFAULT_SHARE", "PacedEngine", "head_cost", "lower_priority", "pieces"]
