"""Prometheus counter of the requests the head's queues started per tenant (``fair_queue``'s
``served``), written only from ``describe()["tenants"]`` (``Metrics.update_from_describe``)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter


class TenantMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.started = Counter(
            "triptych_tenant_requests_started",
            "Requests the head's queue started per tenant (a hash of its API key; '' without keys) and kind "
            "(generation, chat): what each tenant's fair share gave it (a retry starts again)",
            ["tenant", "kind"],
            registry=registry,
        )
        self._seen: dict[tuple[str, str], int] = {}

    def record(self, tenants: dict[str, dict[str, int]]) -> None:
        """``tenants``: kind → tenant → requests started so far (cumulative)."""
        for kind, served in tenants.items():
            for tenant, total in served.items():
                delta = total - self._seen.get((kind, tenant), 0)
                if delta > 0:  # cumulative on the head; a restart of the head restarts both
                    self.started.labels(tenant, kind).inc(delta)
                    self._seen[(kind, tenant)] = total
