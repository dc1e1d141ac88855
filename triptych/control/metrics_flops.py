"""Prometheus collectors of the model FLOPs workers execute and their model FLOPs utilisation, written
only from the workers' report windows (``Metrics.record_worker_window``).

``triptych_<role>_flops_total``: model FLOPs the role's workers ran (``triptych.plan.costs`` says what a
row, an encode and a decode count). ``triptych_<role>_mfu{instance}``: an instance's achieved FLOP/s
over the last ``WINDOW_S`` seconds of its reports, divided by its devices' dense bf16 peak (the table
in ``triptych.plan.peaks``; on CPU the fp32 matmul rate it measured); absent while the peak is unknown."""

from __future__ import annotations

import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge

from triptych.core.kinds import ROLES
from triptych.plan.compute_stats import ComputeStats

#: seconds of reports the MFU gauge averages over
WINDOW_S = 60.0


class FlopMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.flops = {
            role: Counter(
                f"triptych_{role}_flops",
                f"Model FLOPs the {role} workers executed (rows run, CFG branches included; rows TeaCache "
                "skipped count nothing)",
                registry=registry,
            )
            for role in ROLES
        }
        self.mfu = {
            role: Gauge(
                f"triptych_{role}_mfu",
                f"Model FLOPs utilisation of a {role} instance: its FLOP/s over the last {WINDOW_S:.0f} s of "
                "reports / its devices' dense bf16 peak (CPU: measured fp32 matmul rate)",
                ["instance"],
                registry=registry,
            )
            for role in ROLES
        }
        self._windows: dict[str, deque[tuple[float, float, float]]] = {}  # instance -> (at, flops, seconds)

    def record(self, role: str, instance: str, window: ComputeStats, seconds: float, now: float | None = None) -> None:
        self.flops[role].inc(max(window.flops, 0.0))
        if window.peak_flops <= 0:
            return
        now = time.monotonic() if now is None else now
        recent = self._windows.setdefault(instance, deque())
        recent.append((now, window.flops, seconds))
        while recent and recent[0][0] < now - WINDOW_S:
            recent.popleft()
        span = sum(s for _, _, s in recent)
        if span > 0:
            self.mfu[role].labels(instance).set(sum(f for _, f, _ in recent) / span / window.peak_flops)
