"""The server's Prometheus metrics (text format at ``GET /metrics``).

Counters and histograms are updated as requests finish; the gauges (running, waiting, KV
blocks) are read from the engines at scrape time, so they are never stale. Each app has its
own registry, so several servers (or tests) in one process do not share numbers. Names follow
Prometheus conventions (https://prometheus.io/docs/practices/naming/): base units (seconds),
``_total`` for counters.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# Buckets spanning a fast GPU (milliseconds) to a busy 2-core CPU (tens of seconds).
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class ServerMetrics:
    def __init__(self, engines: dict, cache=None):
        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "minillm_requests", "HTTP requests answered", ["model", "endpoint", "status"], registry=r
        )
        self.rejected = Counter("minillm_requests_rejected", "Requests refused before running", ["reason"], registry=r)
        self.aborted = Counter("minillm_requests_aborted", "Requests aborted (client gone)", ["model"], registry=r)
        self.prompt_tokens = Counter("minillm_prompt_tokens", "Prompt tokens processed", ["model"], registry=r)
        self.generation_tokens = Counter("minillm_generation_tokens", "Tokens generated", ["model"], registry=r)
        self.ttft = Histogram(
            "minillm_time_to_first_token_seconds",
            "Arrival to first token",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "minillm_time_per_output_token_seconds", "Mean gap between later tokens", ["model"], buckets=_TPOT_BUCKETS,
            registry=r,
        )  # fmt: skip
        self.e2e = Histogram(
            "minillm_e2e_request_latency_seconds",
            "Arrival to last token",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        gauges = {
            "minillm_num_requests_running": ("Requests running in the engine", lambda e: e.num_running),
            "minillm_num_requests_waiting": ("Requests waiting for a seat", lambda e: e.num_waiting),
            "minillm_kv_blocks_used": ("KV pool blocks in use", _blocks_used),
            "minillm_kv_blocks_total": ("KV pool blocks", _blocks_total),
        }
        for name, (doc, read) in gauges.items():
            gauge = Gauge(name, doc, ["model"], registry=r)
            for model, engine in engines.items():
                gauge.labels(model).set_function(lambda read=read, engine=engine: read(engine))
        if cache is not None:
            r.register(_CacheCollector(cache))

    def observe_finished(self, model: str, output) -> None:
        """Count one finished sample (an engine ``RequestOutput``)."""
        m = output.metrics
        self.generation_tokens.labels(model).inc(len(output.token_ids))
        if output.finish_reason == "abort":
            self.aborted.labels(model).inc()
            return
        if getattr(output, "index", 0):  # latencies once per request: sample 0 stands for its n samples
            return
        for hist, value in ((self.ttft, m.ttft), (self.tpot, m.tpot), (self.e2e, m.e2e_latency)):
            if value is not None:
                hist.labels(model).observe(value)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _blocks_used(engine) -> float:
    bm = engine.engine.block_manager
    return 0 if bm is None else bm.num_used_blocks


def _blocks_total(engine) -> float:
    bm = engine.engine.block_manager
    return 0 if bm is None else bm.num_blocks


class _CacheCollector:
    """Reads the response cache's own counters at scrape time (no second copy to keep in step)."""

    def __init__(self, cache):
        self.cache = cache

    def collect(self):
        yield CounterMetricFamily("minillm_response_cache_hits", "Response cache hits", value=self.cache.hits)
        yield CounterMetricFamily("minillm_response_cache_misses", "Response cache misses", value=self.cache.misses)
        yield GaugeMetricFamily("minillm_response_cache_entries", "Responses held", value=len(self.cache))
