"""Prometheus counter of the transfer requests the workers' endpoints refused, written only from the
workers' report windows (``Metrics.record_worker_window``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter

if TYPE_CHECKING:  # the head imports this module: the transfer package imports torch
    from triptych.transfer.stats import TransferStats


class TransferRefusals:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.refused = Counter(
            "triptych_transfer_refused",
            "Transfer-plane requests a worker's endpoint refused, by reason: unauthenticated (no valid "
            "capability: no or another token, or sealed for another slot), replay (authentic, for a slot "
            "already filled or released), other (unreserved, wrong size, expired)",
            ["reason"],
            registry=registry,
        )

    def record(self, window: TransferStats) -> None:
        other = window.rejected_pushes - window.unauthenticated - window.replays_refused
        self.refused.labels("unauthenticated").inc(window.unauthenticated)
        self.refused.labels("replay").inc(window.replays_refused)
        self.refused.labels("other").inc(max(0, other))
