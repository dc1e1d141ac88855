"""Prometheus series of the denoisers' preemption (``triptych.engine.parking``), written only from the
denoisers' report windows (``Metrics.record_worker_window``): the parked requests and their bytes per
instance (latest), and the preemptions counted over all."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge


class ParkingMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.preemptions = Counter(
            "triptych_denoiser_preemptions",
            "Requests parked at a step boundary because more urgent work took their batch places",
            registry=registry,
        )
        self.parked = Gauge(
            "triptych_denoiser_parked_requests", "Requests parked now, per denoiser", ["instance"], registry=registry
        )
        self.parked_bytes = Gauge(
            "triptych_denoiser_parked_bytes",
            "Bytes of parked request state now, per denoiser (host memory on CUDA, counted in place elsewhere)",
            ["instance"],
            registry=registry,
        )

    def record(self, instance_id: str, engine_window) -> None:
        self.preemptions.inc(engine_window.preemptions)
        self.parked.labels(instance_id).set(engine_window.parked)
        self.parked_bytes.labels(instance_id).set(engine_window.parked_bytes)

    def forget(self, instance_id: str) -> None:
        for gauge in (self.parked, self.parked_bytes):
            try:
                gauge.remove(instance_id)
            except KeyError:
                pass
