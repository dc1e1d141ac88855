"""Prometheus collectors of cross-encoder embedding hits (``worker.mm_remote``), written only from
the encoders' report windows (``Metrics.record_worker_window``)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

from triptych.mmcache.stats import RemoteStats

#: How a fetch from another encoder ended (``RemoteStats``' field for each).
FETCH_RESULTS = {"hit": "hits", "unreachable": "unreachable", "refused": "refused", "tokens": "tokens"}


class RemoteMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.fetches = Counter(
            "triptych_encoder_remote_fetches",
            "Embedding misses an encoder asked another encoder for (the head's hint), by result: hit, or "
            "a fallback to its own vision tower (unreachable: no answer in time; refused: the holder no longer "
            "has it; tokens: another token count than the request needs)",
            ["result"],
            registry=registry,
        )
        self.bytes = Counter(
            "triptych_encoder_remote_bytes",
            "Embedding bytes moved encoder to encoder by remote hits",
            registry=registry,
        )
        self.lent = Counter(
            "triptych_encoder_remote_lent",
            "Embeddings an encoder pushed to another that asked for them, by result (lent, failed)",
            ["result"],
            registry=registry,
        )

    def record(self, window: RemoteStats) -> None:
        for result, name in FETCH_RESULTS.items():
            self.fetches.labels(result).inc(getattr(window, name))
        self.bytes.inc(window.bytes)
        self.lent.labels("lent").inc(window.lent)
        self.lent.labels("failed").inc(window.lend_failed)
