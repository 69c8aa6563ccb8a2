"""The evaluation context: logits and losses of one sequence alone, beside the serving context.

`Engine.logits`, `Engine.loss` and `Engine.loss_sum` run here, on the engine thread, in a context of
their own (made on first use) so that they never share a batch or KV cells with served requests. An
evaluation on an adapter set the KV guard calls risky may leave out-of-range K/V in its cells: the next
evaluation then clears the cells' data, not only their positions (engine/kv_guard.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from .control import ControlSetting
from .kv_guard import KvGuard
from .model import Context, ContextOptions, Model
from .registry import LoraArg, Registry, requested_names


class Evaluator:
    """One sequence's context for evaluations (engine thread only)."""

    def __init__(self, model: Model, opts: ContextOptions, registry: Registry,
                 use_now: Callable[[list[str]], None], guard: KvGuard | None) -> None:
        """`use_now(names)` makes evicted adapters loaded again before they are set (residency.py)."""
        self.model, self.opts, self.registry = model, opts, registry
        self._use_now, self._guard = use_now, guard
        self.ctx: Context | None = None
        self._risky = False  # the last evaluation ran a risky adapter set

    def prepare(self, loras: LoraArg, control: ControlSetting | None) -> Context:
        """The context, cleared, with `loras` and `control` set on it."""
        if self.ctx is None:
            self.ctx = Context(self.model, self.opts)
        ctx = self.ctx
        self._use_now(requested_names(loras, self.registry.active))
        aset = self.registry.adapter_set(loras)
        if self._risky:  # the last evaluation's cells may hold out-of-range K/V: zero the data
            ctx.clear()
        self._risky = self._guard is not None and self._guard.risky([aset])
        ctx.handle.set_adapters([a.handle for a, _ in aset.items], [s for _, s in aset.items])
        if control is None:
            ctx.handle.set_control_vector(None, self.model.n_embd, 0, 0)
        else:
            control.apply(ctx.handle)
        ctx.clear(0)
        return ctx

    def logits(self, tokens: Sequence[int], loras: LoraArg, control: ControlSetting | None) -> np.ndarray:
        """Logits of every position (n_tokens × n_vocab)."""
        out = self.prepare(loras, control).prefill(0, list(tokens), all_logits=True)
        assert out is not None
        return out

    def loss_sum(self, texts: Sequence[Sequence[int]], masks: Sequence[Sequence[bool]] | None, loras: LoraArg,
                 control: ControlSetting | None) -> tuple[float, int]:
        """(sum of token NLLs, tokens scored) over `texts`, one at a time (float64 sums)."""
        ctx = self.prepare(loras, control)
        total, count = 0.0, 0
        for i, t in enumerate(texts):
            ctx.clear(0)
            s, c = ctx.token_nll(0, list(t), masks[i] if masks is not None else None)
            total += s
            count += c
        return total, count

    def close(self) -> None:
        if self.ctx is not None:
            self.ctx.close()


__all__ = ["Evaluator"]
