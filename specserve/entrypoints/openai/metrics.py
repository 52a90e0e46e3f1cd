"""Prometheus metrics of one server, in their own registry so that several apps can live in
one process (tests, embedding) without their metric names clashing.

Two kinds: per-request metrics (latencies, finish reasons) are observed by the
server when a request ends; engine state (queue lengths, KV cache, token totals,
speculative decoding) is read at scrape time from the snapshot that comes with each
core's last step, so a scrape never touches an engine itself. Engine state is
reported for the server and for each data-parallel replica.
"""
from __future__ import annotations

import time

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from specserve.engine.async_llm import AsyncLLM
from specserve.outputs import RequestOutput

PREFIX = "specserve:"
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.2, 2.5)


# Engine state: (name, help, family, its value in a snapshot).
_ENGINE_METRICS = [
    ("num_requests_running", "Requests the engine is stepping.", GaugeMetricFamily, lambda s: s.num_running),
    ("num_requests_waiting", "Requests queued for admission.", GaugeMetricFamily, lambda s: s.num_waiting),
    ("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0 to 1).", GaugeMetricFamily,
     lambda s: s.kv_cache_usage),
    ("prefix_cache_hit_rate", "Fraction of queried prompt tokens found in the prefix cache.", GaugeMetricFamily,
     lambda s: s.prefix_cache_hit_rate),
    ("prompt_tokens", "Prefill tokens processed: each sequence's prompt (n per request of n sequences), counted when "
     "its first token is generated, those found in the prefix cache included.", CounterMetricFamily,
     lambda s: s.num_prompt_tokens),
    ("prompt_tokens_cached", "Of prompt_tokens, those served by the prefix cache (prompt_tokens minus this: those "
     "computed).", CounterMetricFamily, lambda s: s.num_cached_prompt_tokens),
    ("generation_tokens", "Tokens generated, those of requests aborted later included.", CounterMetricFamily,
     lambda s: s.num_generated_tokens),
    ("spec_decode_num_drafted_tokens", "Draft tokens proposed.", CounterMetricFamily, lambda s: s.spec_num_drafted),
    ("spec_decode_num_accepted_tokens", "Draft tokens accepted.", CounterMetricFamily, lambda s: s.spec_num_accepted),
    ("spec_decode_steps_drafting", "Steps whose requests proposed drafts.", CounterMetricFamily,
     lambda s: s.spec_steps_drafting),
    ("spec_decode_steps_without_drafts", "Steps the speculation policy kept from drafting.", CounterMetricFamily,
     lambda s: s.spec_steps_without_drafts),
]
_PER_POSITION = ("spec_decode_acceptance_per_position", "Fraction of drafts accepted at each draft position.")


class EngineStatsCollector(Collector):
    """Each engine-state metric twice: under its name for the whole server (every replica's counts summed, its
    ratios the ratios of the sums), and as `replica_<name>` with a `replica` label, one sample per data-parallel
    replica. The two never share a name, so a sum over either counts each request once."""

    def __init__(self, engine: AsyncLLM):
        self.engine = engine

    def collect(self):
        total, replicas = self.engine.stats, self.engine.replica_stats
        for name, doc, family, value in _ENGINE_METRICS:
            yield family(PREFIX + name, doc + " All replicas.", value=value(total))
            per_replica = family(PREFIX + "replica_" + name, doc + " One replica.", labels=["replica"])
            for index, s in enumerate(replicas):
                per_replica.add_metric([str(index)], value(s))
            yield per_replica
        name, doc = _PER_POSITION
        per_pos = GaugeMetricFamily(PREFIX + name, doc + " All replicas.", labels=["position"])
        for position, rate in enumerate(total.spec_acceptance_per_position):
            per_pos.add_metric([str(position)], rate)
        yield per_pos
        per_pos = GaugeMetricFamily(PREFIX + "replica_" + name, doc + " One replica.", labels=["replica", "position"])
        for index, s in enumerate(replicas):
            for position, rate in enumerate(s.spec_acceptance_per_position):
                per_pos.add_metric([str(index), str(position)], rate)
        yield per_pos


class ServerMetrics:
    def __init__(self, engine: AsyncLLM):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(PREFIX + "requests", "Sequences ended (a request's n each, as vLLM counts "
                                "them), by finish reason (stop, length, abort: the client left, timeout, error).",
                                ["finish_reason"], registry=r)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Arrival to first generated token.",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram(PREFIX + "time_per_output_token_seconds",
                              "Mean time between generated tokens after the first, per request.",
                              buckets=_TOKEN_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Arrival to last token.",
                             buckets=_LATENCY_BUCKETS, registry=r)
        r.register(EngineStatsCollector(engine))

    def record_request(self, finish_reasons: list[str], last: RequestOutput | None) -> None:
        """Observe a request that ended, with each sequence's finish reason; `last` is its last output (None if
        it never got one)."""
        for reason in finish_reasons:
            self.requests.labels(reason).inc()
        if last is None:
            return
        m = last.metrics
        n = m.num_output_tokens
        # The engine's times are time.monotonic() readings, so the same clock ends aborted requests.
        end = m.finished_time if m.finished_time is not None else time.monotonic()
        self.e2e.observe(end - m.arrival_time)
        if m.first_token_time is not None:
            self.ttft.observe(m.first_token_time - m.arrival_time)
            if n > 1:
                self.tpot.observe((end - m.first_token_time) / (n - 1))

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
