"""Histograms fed from workers' bucket counts (``core.buckets``): each observation was counted in its
bucket where it happened (an engine tick, a tensor push), and the head adds each report window's
per-bucket deltas, so every bucket, the sum and the count are the real observations' (none is a
window's mean spread over its events)."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import HistogramMetricFamily
from prometheus_client.utils import floatToGoString


class ReportedHistogram:
    """A Prometheus histogram (``name`` without ``_bucket``/``_sum``/``_count``) over fixed ``bounds``."""

    def __init__(
        self,
        name: str,
        documentation: str,
        bounds: Sequence[float],
        registry: CollectorRegistry,
        labelnames: Sequence[str] = (),
    ):
        self.name, self.documentation = name, documentation
        self.bounds = tuple(bounds)
        self.labelnames = tuple(labelnames)
        self._series: dict[tuple[str, ...], tuple[list[int], list[float]]] = {}  # labels -> (counts, [sum])
        registry.register(self)

    def add(self, counts: Sequence[int], total: float, labels: Sequence[str] = ()) -> None:
        """One window: ``counts`` per bucket (``core.buckets``, +Inf last) and the observations' sum.
        An empty ``counts`` (nothing observed, or a worker that does not count buckets) adds nothing."""
        if not any(counts):
            return
        if len(counts) != len(self.bounds) + 1:
            raise ValueError(f"{self.name}: {len(counts)} bucket counts for {len(self.bounds)} bounds + Inf")
        have, total_ = self._series.setdefault(tuple(labels), ([0] * (len(self.bounds) + 1), [0.0]))
        for i, n in enumerate(counts):
            have[i] += n
        total_[0] += total

    def describe(self):
        return [HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)]

    def collect(self):
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        les = [floatToGoString(b) for b in self.bounds] + ["+Inf"]
        for labels, (counts, total) in self._series.items():
            family.add_metric(list(labels), list(zip(les, accumulate(counts), strict=True)), total[0])
        yield family
