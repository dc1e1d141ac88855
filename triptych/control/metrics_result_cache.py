"""Prometheus series of the head's result cache (``triptych.head.result_cache``), read from its
stats when ``/metrics`` is scraped (the cache keeps plain counters; this is their only exporter).

The cache is one per head, shared by its models, so its series carry no ``model`` label.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


class _Collector:
    def __init__(self, stats: Callable[[], Any]):
        self.stats = stats

    def collect(self):
        s = self.stats()
        lookups = CounterMetricFamily(
            "triptych_result_cache_lookups",
            "Images and videos looked up in the head's result cache: hit (answered from it, no worker ran), "
            "miss (ran, then stored), bypassed (no seed, result_cache=false, or the cache is off)",
            labels=["result"],
        )
        for result in ("hit", "miss", "bypassed"):
            lookups.add_metric([result], {"hit": s.hits, "miss": s.misses, "bypassed": s.bypassed}[result])
        yield lookups
        dropped = CounterMetricFamily(
            "triptych_result_cache_evictions",
            "Results evicted from the result cache to make room (evicted), or never stored: larger than it (not_stored)",
            labels=["reason"],
        )
        dropped.add_metric(["evicted"], s.evictions)
        dropped.add_metric(["not_stored"], s.not_stored)
        yield dropped
        yield GaugeMetricFamily("triptych_result_cache_bytes", "Bytes of results held in the result cache", s.nbytes)
        yield GaugeMetricFamily("triptych_result_cache_entries", "Results held in the result cache", s.entries)
        yield GaugeMetricFamily(
            "triptych_result_cache_capacity_bytes", "The result cache's capacity (0: off)", s.capacity_bytes
        )


class ResultCacheMetrics:
    """The result cache's series, in a registry of their own (``render`` at each scrape)."""

    def __init__(self, stats: Callable[[], Any]):
        """``stats``: returns the cache's current ``ResultCacheStats``."""
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(stats))

    def render(self) -> bytes:
        return generate_latest(self.registry)
