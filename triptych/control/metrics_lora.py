"""Prometheus counters of the denoisers' LoRA adapter budgets (``triptych.lora``), written only from
the denoisers' report windows (``Metrics.record_worker_window``)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

#: ``EngineStats.lora_<name>`` counters, each exported as ``triptych_denoiser_lora_<name>_total``.
LORA_COUNTERS = ("loaded", "evicted", "hits", "misses", "mixed_batches")


class LoraMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        doc = "LoRA adapters of a denoiser's budget: {} (mixed batches: forwards mixing adapters)"
        self.counters = {
            f"lora_{n}": Counter(f"triptych_denoiser_lora_{n}", doc.format(n), registry=registry) for n in LORA_COUNTERS
        }

    def record(self, engine_window) -> None:
        for field, counter in self.counters.items():
            counter.inc(getattr(engine_window, field))
