"""What the server's routes share: the engine, the settings, the adapter pool, control vectors, metrics."""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict

from ..engine.control import ControlSetting, ControlVector, parse_layers
from ..engine.runtime import Engine
from .config import ServerSettings
from .errors import APIError
from .metrics import Metrics, ServerSnapshot
from .pool import AdapterPool
from .schemas import ControlRef

UNKNOWN = "_unknown_"  # metrics label for model names that are not served (keeps label sets bounded)
CONTROL_CACHE = 64
RETRY_AFTER = "1"  # seconds, in a 429's Retry-After (the openai client waits that long before its retry)


class Ticket:
    """One accepted request's place among the `queue_limit` the server takes at once; released once."""

    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.held = True

    def release(self) -> None:
        if self.held:
            self.held = False
            self.state.in_flight -= 1


class ServerState:
    """What the routes share: engine, settings, adapter table, control vectors, metrics."""

    def __init__(self, engine: Engine, settings: ServerSettings, base_name: str) -> None:
        self.engine = engine
        self.settings = settings
        self.base_name = base_name
        self.started = int(time.time())
        self.pool = AdapterPool(engine, settings, base_name)
        self.metrics = Metrics(self.snapshot, settings.metric_adapters)
        self.controls = _load_controls(settings)
        self._control_cache: OrderedDict[tuple[str, float], ControlSetting] = OrderedDict()
        self.in_flight = 0  # generation requests accepted and not finished (event loop only)

    # -- admission ----------------------------------------------------------------------------
    def admit(self) -> Ticket:
        """Accept one more generation request, or refuse it with 429 when `queue_limit` are in flight
        (running or waiting): the queue is bounded here, before any tokenizing or engine work."""
        parallel = self.engine.n_parallel
        limit = self.settings.queue_limit(parallel)
        if self.in_flight >= limit:
            raise APIError(429, f"the server is busy: {limit} requests are in flight (--parallel {parallel} "
                                f"running, --max-queue {limit - parallel} waiting); retry shortly",
                           code="queue_full", headers={"Retry-After": RETRY_AFTER})
        self.in_flight += 1
        return Ticket(self)

    # -- metrics ------------------------------------------------------------------------------
    def snapshot(self) -> ServerSnapshot:
        """The scheduler's load and the adapter table, for /metrics and /slots. On the event loop only (the
        adapter table is the loop's); the record it returns may be read on any thread."""
        s = self.engine.scheduler.snapshot()
        resident = tuple(e.name for e in self.pool.resident())
        waiting = set(s.waiting_adapters) - set(resident)
        return ServerSnapshot(engine=s, resident=resident, known=len(self.pool.entries),
                              waiting_not_resident=tuple(sorted(waiting)),
                              max_lora=self.settings.max_loaded or max(1, len(resident)),
                              evictions=self.pool.evictions, loads=dict(self.pool.loads), in_flight=self.in_flight)

    def label(self, model: str | None) -> str:
        if model is None or model == self.base_name:
            return self.base_name
        return self.metrics.adapter_label(model) if model in self.pool.entries else UNKNOWN

    def record(self, model: str | None, status: int, *, started: float, first_token_at: float | None = None,
               prompt_tokens: int = 0, generated_tokens: int | None = None) -> None:
        """Count one finished request: status, latency, time to first token, tokens (when it completed)."""
        m, label = self.metrics, self.label(model)
        m.requests.labels(label, str(status)).inc()
        m.e2e.labels(label).observe(time.monotonic() - started)
        if first_token_at is not None:
            m.ttft.labels(label).observe(max(0.0, first_token_at - started))
        if generated_tokens is not None:
            if first_token_at is not None:
                m.add_phase_times(first_token_at - started, time.monotonic() - first_token_at)
            m.prompt_tokens.labels(label).inc(prompt_tokens)
            m.generation_tokens.labels(label).inc(generated_tokens)

    # -- control vectors ----------------------------------------------------------------------
    async def control_setting(self, ref: ControlRef | None) -> ControlSetting | None:
        """The control setting a request names, or None when it names none (the engine's own applies)."""
        if ref is None:
            return None
        if ref.name not in self.controls:
            known = ", ".join(sorted(self.controls)) or "none loaded (start the server with --control-vector)"
            raise APIError(404, f"no control vector named {ref.name!r} (loaded: {known})",
                           code="control_vector_not_found", param="control_vector")
        key = (ref.name, float(ref.strength))
        if key not in self._control_cache:
            vec, layers = self.controls[ref.name]
            setting = await asyncio.to_thread(ControlSetting.build, self.engine.model, [(vec, ref.strength)], layers)
            self._control_cache[key] = setting
            while len(self._control_cache) > CONTROL_CACHE:
                self._control_cache.popitem(last=False)
        self._control_cache.move_to_end(key)
        return self._control_cache[key]

    def healthy(self) -> bool:
        return not self.engine.closed


def _load_controls(settings: ServerSettings) -> dict[str, tuple[ControlVector, tuple[int, int] | None]]:
    if not settings.control_vectors:
        return {}
    out = {}
    for c in settings.control_vectors:
        out[c.name] = (ControlVector.load(c.path), parse_layers(c.layers or settings.control_vector_layers))
    return out


__all__ = ["CONTROL_CACHE", "RETRY_AFTER", "UNKNOWN", "ServerState", "Ticket"]
