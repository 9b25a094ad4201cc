"""Prometheus metrics under vLLM's names, prefixed `serval:`, label `model_name`.

Two sources:
- the engine's `SchedulerStats` (client.latest_stats): gauges are current
  values and counters are totals since the engine started, so they are read
  at scrape time by `EngineStatsCollector` rather than incremented here;
- the API process itself: token counters, finished requests by reason and the
  latency histograms, observed per sequence by `SequenceTimer`.

Each app gets its own `CollectorRegistry`, so several apps (tests) never
clash on the global one.
"""

from __future__ import annotations

import time
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from scheduler.types import SchedulerStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Buckets as vLLM uses them (seconds).
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                    60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class EngineStatsCollector(Collector):
    """Reads the latest engine stats at scrape time."""

    def __init__(self, get_stats: Callable[[], SchedulerStats | None], model_name: str):
        self._get_stats = get_stats
        self._model_name = model_name

    def collect(self):
        stats = self._get_stats() or SchedulerStats()
        labels = ["model_name"]
        values = [self._model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(f"serval:{name}", doc, labels=labels)
            g.add_metric(values, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(f"serval:{name}", doc, labels=labels)
            c.add_metric(values, value)
            return c

        yield gauge("num_requests_running", "Number of requests in the running batch.", stats.num_running_reqs)
        yield gauge("num_requests_waiting", "Number of requests waiting to be scheduled.", stats.num_waiting_reqs)
        yield gauge("kv_cache_usage_perc", "KV cache usage, 1 means 100 percent.", stats.kv_cache_usage)
        yield counter("num_preemptions", "Cumulative number of preemptions.", stats.num_preemptions_total)
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      stats.prefix_cache_queries_total)
        yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.", stats.prefix_cache_hits_total)


class ServerMetrics:
    def __init__(self, model_name: str, get_stats: Callable[[], SchedulerStats | None]):
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(EngineStatsCollector(get_stats, model_name))
        labels = ["model_name"]
        r = self.registry
        self.prompt_tokens = Counter("serval:prompt_tokens", "Number of prefill tokens processed.",
                                     labels, registry=r).labels(model_name)
        self.generation_tokens = Counter("serval:generation_tokens", "Number of generation tokens processed.",
                                         labels, registry=r).labels(model_name)
        self._success = Counter("serval:request_success", "Count of finished requests by finish reason.",
                                labels + ["finished_reason"], registry=r)
        for reason in ("stop", "length", "abort"):
            self._success.labels(model_name, reason)
        self.ttft = Histogram("serval:time_to_first_token_seconds", "Time to first token in seconds.",
                              labels, buckets=_TTFT_BUCKETS, registry=r).labels(model_name)
        self.itl = Histogram("serval:inter_token_latency_seconds", "Time between output tokens in seconds.",
                             labels, buckets=_ITL_BUCKETS, registry=r).labels(model_name)
        self.e2e = Histogram("serval:e2e_request_latency_seconds", "End-to-end request latency in seconds.",
                             labels, buckets=_REQUEST_BUCKETS, registry=r).labels(model_name)
        self.queue_time = Histogram("serval:request_queue_time_seconds",
                                    "Time a request waited before it was first scheduled, in seconds.",
                                    labels, buckets=_REQUEST_BUCKETS, registry=r).labels(model_name)

    def request_finished(self, reason: str) -> None:
        self._success.labels(self.model_name, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class SequenceTimer:
    """Latency bookkeeping for one generated sequence.

    arrival -> first output (TTFT) -> each later output (ITL) -> finish (E2E);
    queue time is the engine's first-scheduled wall time minus arrival.
    """

    __slots__ = ("metrics", "arrival", "arrival_wall", "last", "num_tokens", "queue_observed")

    def __init__(self, metrics: ServerMetrics, arrival: float, arrival_wall: float):
        self.metrics = metrics
        self.arrival = arrival  # time.monotonic()
        self.arrival_wall = arrival_wall  # time.time(), comparable with the engine's clock
        self.last: float | None = None
        self.num_tokens = 0
        self.queue_observed = False

    def on_output(self, num_new_tokens: int, first_scheduled_time: float | None) -> None:
        now = time.monotonic()
        if first_scheduled_time is not None and not self.queue_observed:
            self.queue_observed = True
            self.metrics.queue_time.observe(max(0.0, first_scheduled_time - self.arrival_wall))
        if num_new_tokens <= 0:
            return
        # One ITL sample per output token after the first. A delta can carry
        # several tokens (a backlog merged for a slow consumer): its interval
        # is shared evenly among them, e.g. 3 tokens 30 ms after the last
        # delta -> three samples of 10 ms; extra tokens in the first delta
        # arrived with it (0 s each).
        if self.last is None:
            self.metrics.ttft.observe(now - self.arrival)
            for _ in range(num_new_tokens - 1):
                self.metrics.itl.observe(0.0)
        else:
            gap = (now - self.last) / num_new_tokens
            for _ in range(num_new_tokens):
                self.metrics.itl.observe(gap)
        self.last = now
        self.num_tokens += num_new_tokens
        self.metrics.generation_tokens.inc(num_new_tokens)

    def on_finish(self, reason: str) -> None:
        self.metrics.e2e.observe(time.monotonic() - self.arrival)
        self.metrics.request_finished(reason)
