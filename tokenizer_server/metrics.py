"""Prometheus /metrics: engine figures from the worker's latest snapshot, latencies measured here.

The worker sends an EngineStats snapshot with its step outputs (at most every
stats_interval_s, and whenever it goes idle); a collector turns the latest one into
gauges and counters at scrape time. Latency histograms are observed in the front,
where the client's clock runs. Each app has its own registry, so several servers
(or tests) in one process never share series.
"""

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class _EngineCollector:
    def __init__(self, get_stats, get_up):
        self._get_stats = get_stats
        self._get_up = get_up

    def collect(self):
        up = GaugeMetricFamily("radixkv_worker_up", "1 while the engine worker is alive and ready")
        up.add_metric([], 1.0 if self._get_up() else 0.0)
        yield up
        s = self._get_stats()
        if s is None:
            return
        gauges = {
            "radixkv_kv_cache_usage_fraction": (
                "fraction of KV blocks held by live requests", s.in_use_blocks / max(s.num_blocks, 1)
            ),
            "radixkv_kv_blocks_total": ("KV blocks in the pool", s.num_blocks),
            "radixkv_kv_blocks_free": ("KV blocks on the free list", s.free_blocks),
            "radixkv_kv_blocks_evictable": ("cached KV blocks no request holds (evictable)", s.evictable_blocks),
            "radixkv_kv_blocks_in_use": ("KV blocks held by live requests", s.in_use_blocks),
            "radixkv_kv_block_size_tokens": ("tokens per KV block", s.block_size),
            "radixkv_num_requests_running": ("requests being scheduled", s.running),
            "radixkv_num_requests_waiting": ("requests waiting for admission", s.waiting),
        }
        for name, (doc, value) in gauges.items():
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], float(value))
            yield g
        counters = {
            "radixkv_prefix_cache_queries_tokens": (
                "prompt tokens looked up in the prefix cache", s.prefix_query_tokens
            ),
            "radixkv_prefix_cache_hits_tokens": ("prompt tokens found in the prefix cache", s.prefix_hit_tokens),
            "radixkv_num_preemptions": ("requests preempted (recomputed later)", s.preemptions),
            "radixkv_prompt_tokens": ("prompt tokens admitted", s.prompt_tokens),
            "radixkv_generation_tokens": ("tokens generated", s.generation_tokens),
            "radixkv_cache_invariant_checks": ("idle-time cache invariant checks passed", s.invariant_checks),
            "radixkv_requests_failed": ("requests the engine failed while the worker went on", s.requests_failed),
        }
        for name, (doc, value) in counters.items():
            c = CounterMetricFamily(name, doc)
            c.add_metric([], float(value))
            yield c


class ServerMetrics:
    def __init__(self, get_stats, get_up):
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_EngineCollector(get_stats, get_up))
        self.ttft = Histogram(
            "radixkv_time_to_first_token_seconds", "time from request arrival to its first token",
            buckets=_LATENCY_BUCKETS, registry=self.registry,
        )
        self.itl = Histogram(
            "radixkv_inter_token_latency_seconds", "time between successive output tokens of a request",
            buckets=_LATENCY_BUCKETS, registry=self.registry,
        )
        self.e2e = Histogram(
            "radixkv_e2e_request_latency_seconds", "time from request arrival to its last token",
            buckets=_LATENCY_BUCKETS, registry=self.registry,
        )
        self.requests = Counter(
            "radixkv_requests", "finished choices (samples) by finish reason",
            ["finish_reason"], registry=self.registry,
        )

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
