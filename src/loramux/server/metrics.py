"""Prometheus metrics, one registry per app.

Besides loramux's own metrics this speaks the Gateway API Inference Extension's model-server
protocol, so its reference endpoint picker (tuned to vLLM) works unchanged:

- `vllm:num_requests_waiting` (gauge): requests queued, not yet holding a sequence slot;
- `vllm:num_requests_running` (gauge): requests holding a slot;
- `vllm:gpu_cache_usage_perc` and its newer name `vllm:kv_cache_usage_perc` (gauge, 0..1): the fraction
  of the serving context's KV cells that running sequences occupy (cells kept only for prefix reuse
  count as free: they are dropped whenever a slot is needed);
- `vllm:lora_requests_info` (gauge, value = the time of this scrape, so the picker takes the newest):
  labels `max_lora` (`--max-loaded`, else the number of resident adapters), `running_lora_adapters`
  (resident adapters: every one of them is ready to serve without a load, which is what the picker
  means by "loaded"), `waiting_lora_adapters` (adapters that queued requests wait for and that are
  not resident: being reloaded after an LRU eviction).

and llama-server's `llamacpp:*` families (prompt and generated tokens and seconds, decode calls, requests
processing and deferred, KV usage), so dashboards built for llama-server read loramux too.
"""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from prometheus_client import CollectorRegistry, Counter, GCCollector, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from ..engine.stats import SchedulerSnapshot

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _no_counts() -> Mapping[str, int]:
    return MappingProxyType({})


@dataclass(frozen=True, slots=True)
class ServerSnapshot:
    """What a scrape reads: the scheduler's load and the server's adapter table, taken on the event loop."""

    engine: SchedulerSnapshot = SchedulerSnapshot()
    resident: tuple[str, ...] = ()  # adapters loaded in memory, in the pool's order
    known: int = 0  # adapters the server can serve (resident or evicted)
    waiting_not_resident: tuple[str, ...] = ()  # adapters queued requests wait for that are not resident
    max_lora: int = 1  # --max-loaded, else the number of resident adapters (at least 1)
    evictions: int = 0  # adapters evicted by the LRU (--max-loaded)
    loads: Mapping[str, int] = field(default_factory=_no_counts)  # runtime adapter loads by result
    in_flight: int = 0  # generation requests accepted and not finished


@dataclass(slots=True)
class PhaseSeconds:
    """Totals of finished requests' prompt time (arrival to first token) and generation time (first token
    to the end), for llama-server's `llamacpp:*_seconds` families. Written on the event loop only."""

    prompt: float = 0.0
    predict: float = 0.0


class _LiveCollector:
    """Gauges read at scrape time from the engine's scheduler and the adapter table."""

    def __init__(self, snapshot: Callable[[], ServerSnapshot], phases: PhaseSeconds) -> None:
        self.snapshot = snapshot
        self.phases = phases
        self.taken: ServerSnapshot | None = None  # a snapshot taken by the caller of Metrics.render

    def describe(self) -> list[Metric]:
        return []  # live values: nothing to check for name clashes at registration

    def collect(self) -> Iterator[Metric]:
        s: ServerSnapshot = self.taken if self.taken is not None else self.snapshot()
        e = s.engine
        for name, doc, value in (
            ("vllm:num_requests_waiting", "Requests waiting for a sequence slot.", e.waiting),
            ("vllm:num_requests_running", "Requests holding a sequence slot.", e.running),
            ("vllm:gpu_cache_usage_perc", "Fraction of KV cells used by running sequences (0..1).", e.kv_usage),
            ("vllm:kv_cache_usage_perc", "Fraction of KV cells used by running sequences (0..1).", e.kv_usage),
            ("loramux_num_requests_waiting", "Requests waiting for a sequence slot.", e.waiting),
            ("loramux_num_requests_running", "Requests holding a sequence slot.", e.running),
            ("loramux_kv_cache_usage_ratio", "Fraction of KV cells used by running sequences (0..1).", e.kv_usage),
            ("loramux_resident_adapters", "Adapters loaded in memory.", len(s.resident)),
            ("loramux_known_adapters", "Adapters the server can serve (resident or evicted).", s.known),
            ("loramux_requests_in_flight", "Generation requests accepted and not finished (at most "
             "--parallel + --max-queue; more get 429).", s.in_flight),
            ("loramux_slot_wait_p50_seconds", "Median wait of recent banked requests for bank slots.",
             e.slot_waits.p50_s),
            ("loramux_slot_wait_p99_seconds", "99th percentile wait of recent banked requests for bank slots "
             "(bounded: see docs/scaling.md).", e.slot_waits.p99_s),
            ("loramux_slot_wait_max_steps", "Most decode steps one of the recent banked requests waited for bank "
             "slots (bounded: see docs/scaling.md).", e.slot_waits.max_steps),
            ("loramux_decode_gap_max_seconds", "Longest wall time between two decodes while sequences ran, since "
             "start (adapter loads, evictions, slot writes and sampling between steps).", e.decode_gaps.max_s),
            ("loramux_decode_gap_p99_seconds", "99th percentile of recent gaps between decodes while sequences "
             "ran.", e.decode_gaps.p99_s),
            ("loramux_gc_frozen_objects", "Objects `loramux serve` put out of the garbage collector's reach "
             "at start-up, so that full collections stay short (0: not frozen, an app embedded with create_app).",
             gc.get_freeze_count()),
        ):
            yield GaugeMetricFamily(name, doc, value=value)
        info = GaugeMetricFamily("vllm:lora_requests_info", "Adapter state; value: time of this update.",
                                 labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
        info.add_metric([str(s.max_lora), ",".join(s.resident), ",".join(s.waiting_not_resident)], time.time())
        yield info
        for name, doc, counts in (
            ("loramux_adapter_requests_running", "Running requests per adapter.", e.running_adapters),
            ("loramux_adapter_requests_waiting", "Queued requests per adapter.", e.waiting_adapters),
        ):
            per = GaugeMetricFamily(name, doc, labels=["adapter"])
            for adapter, n in sorted(counts.items()):
                per.add_metric([adapter], n)
            yield per
        yield from _counters(s)
        yield from _llamacpp(e, self.phases)
        loads = CounterMetricFamily("loramux_adapter_loads", "Adapter loads at runtime.", labels=["result"])
        for result, n in s.loads.items():
            loads.add_metric([result], n)
        yield loads


def _counters(s: ServerSnapshot) -> Iterator[Metric]:
    c = s.engine.counters
    for name, doc, value in (
        ("loramux_adapter_switches", "Changes of the adapter set applied to the serving context.",
         c.adapter_switches),
        ("loramux_decode_steps", "Decode calls of the serving context.", c.decode_steps),
        ("loramux_bank_decodes", "Decodes through the slot bank's per-token masks (the others ran one adapter "
         "set natively).", c.bank_decodes),
        ("loramux_adapter_evictions", "Adapters evicted by the LRU (--max-loaded).", s.evictions),
        ("loramux_kv_guarded_decodes", "Decodes run with the KV guard (they held a risky adapter set; "
         "see docs/server.md, 'Numeric safety').", s.engine.kv_guarded_decodes),
        ("loramux_kv_guard_failures", "Requests the KV guard stopped: their keys or values left the "
         "KV cache's range.", c.kv_guard_failures),
        ("loramux_kv_clears", "Times the KV cache's data was zeroed because a failed request may have left "
         "out-of-range keys or values (see docs/server.md, 'Numeric safety').", c.kv_clears),
    ):
        yield CounterMetricFamily(name, doc, value=value)


def _llamacpp(e: SchedulerSnapshot, phases: PhaseSeconds) -> Iterator[Metric]:
    """llama-server's families (what its Grafana dashboards read), from the same counts as loramux's own.
    Throughputs are averages since start (llama-server averages between two scrapes)."""
    c = e.counters
    prompt, cached, gen = c.prompt_tokens, c.prompt_tokens_reused, c.generated_tokens
    t_prompt, t_gen = phases.prompt, phases.predict
    for name, doc, value in (
        ("llamacpp:prompt_tokens", "Number of prompt tokens processed, excluding cached tokens", prompt - cached),
        ("llamacpp:prompt_tokens_cached", "Number of prompt tokens reused from the cache", cached),
        ("llamacpp:prompt_seconds", "Total time spent processing prompts", t_prompt),
        ("llamacpp:tokens_predicted", "Number of generation tokens processed", gen),
        ("llamacpp:tokens_predicted_seconds", "Total time spent generating tokens", t_gen),
        ("llamacpp:n_decode", "Total number of llama_decode() calls", c.decode_steps),
    ):
        yield CounterMetricFamily(name, doc, value=value)
    for name, doc, value in (
        ("llamacpp:prompt_tokens_seconds", "Average prompt throughput in tokens/s",
         (prompt - cached) / t_prompt if t_prompt > 0 else 0.0),
        ("llamacpp:predicted_tokens_seconds", "Average generation throughput in tokens/s",
         gen / t_gen if t_gen > 0 else 0.0),
        ("llamacpp:requests_processing", "Number of requests processing", e.running),
        ("llamacpp:requests_deferred", "Number of requests deferred", e.waiting),
        ("llamacpp:kv_cache_usage_ratio", "KV-cache usage. 1 means 100 percent usage", e.kv_usage),
    ):
        yield GaugeMetricFamily(name, doc, value=value)


OTHER = "_other_"  # the label of adapters past `metric_adapters` (label sets stay bounded)


class Metrics:
    """Counters and histograms updated by the request handlers, plus the live collector.

    Adapter names label series (per model, per adapter) for the first `max_adapters` names seen; requests
    on any other adapter count under `OTHER`, so a server with 100,000 registered adapters keeps /metrics
    to a bounded size. An unloaded adapter's series go (`forget`), which frees its place."""

    def __init__(self, snapshot: Callable[[], ServerSnapshot], max_adapters: int = 100) -> None:
        self.max_adapters = max_adapters
        self._names: set[str] = set()  # adapter names with series of their own
        r = self.registry = CollectorRegistry()
        self.requests = Counter("loramux_requests", "Finished requests by model and HTTP status "
                                "(499: the client went away).", ["model", "status"], registry=r)
        self.adapter_requests = Counter("loramux_adapter_requests", "Generation requests that used each "
                                        "adapter.", ["adapter"], registry=r)
        self.adapter_tokens = Counter("loramux_adapter_generation_tokens", "Tokens generated by requests that "
                                      "used each adapter.", ["adapter"], registry=r)
        self.prompt_tokens = Counter("loramux_prompt_tokens", "Prompt tokens processed.", ["model"], registry=r)
        self.generation_tokens = Counter("loramux_generation_tokens", "Tokens generated.", ["model"], registry=r)
        self.e2e = Histogram("loramux_e2e_request_latency_seconds", "Request latency, arrival to last byte.",
                             ["model"], buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("loramux_time_to_first_token_seconds", "Arrival to first generated token.",
                              ["model"], buckets=LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("loramux_request_queue_time_seconds", "Arrival to admission "
                                    "(submitted to the engine).", ["model"], buckets=LATENCY_BUCKETS, registry=r)
        self.phase_seconds = PhaseSeconds()  # llamacpp:* time totals
        self._live = _LiveCollector(snapshot, self.phase_seconds)
        r.register(self._live)
        GCCollector(registry=r)  # python_gc_*: collections per generation, what the decode gaps can be read beside
        self._render_lock = threading.Lock()
        # every labelled metric, with its label names; the first one is the model or adapter name
        self._labelled: list[tuple[Any, tuple[str, ...]]] = [
            (self.requests, ("model", "status")), (self.adapter_requests, ("adapter",)),
            (self.adapter_tokens, ("adapter",)),
            *((m, ("model",)) for m in (self.prompt_tokens, self.generation_tokens, self.e2e, self.ttft,
                                        self.queue_time))]

    def render(self, snapshot: ServerSnapshot | None = None) -> bytes:
        """The Prometheus text. Safe from any thread when given a snapshot taken where the adapter table
        lives (the event loop): the server renders in a worker thread so scrapes never stall requests."""
        with self._render_lock:
            self._live.taken = snapshot
            try:
                return generate_latest(self.registry)
            finally:
                self._live.taken = None

    def add_phase_times(self, prompt_s: float, predict_s: float) -> None:
        """Add a finished request's prompt time (arrival to first token) and generation time (first token to
        the end) to the llamacpp:*_seconds totals. Called on the event loop only."""
        self.phase_seconds.prompt += max(0.0, prompt_s)
        self.phase_seconds.predict += max(0.0, predict_s)

    def adapter_label(self, name: str) -> str:
        """The label an adapter's series use: its name while fewer than `max_adapters` have one, else OTHER."""
        if name in self._names:
            return name
        if len(self._names) < self.max_adapters:
            self._names.add(name)
            return name
        return OTHER

    def forget(self, name: str) -> None:
        """Remove every series labelled with this model or adapter name (an adapter that was unloaded), so
        label sets hold only names that are served."""
        if name not in self._names:
            return  # never labelled: nothing to walk (an unload of a cold adapter never used)
        self._names.discard(name)
        for metric, labels in self._labelled:
            keys = {tuple(s.labels[k] for k in labels) for family in metric.collect() for s in family.samples
                    if s.labels.get(labels[0]) == name}
            for key in keys:
                try:
                    metric.remove(*key)
                except KeyError:  # removed meanwhile
                    pass


__all__ = ["CONTENT_TYPE", "OTHER", "Metrics", "PhaseSeconds", "ServerSnapshot"]
