"""Counters of one transfer endpoint. Plain data: a Prometheus exporter or a log line reads them."""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass, field


@dataclass
class TransferStats:
    """Monotonic counters; `snapshot()` gives a consistent copy to export."""

    backend: str  # "zmq" or "mooncake"
    reservations: int = 0  # slots reserved on this (receiver) side
    pushes_sent: int = 0  # pushes this (sender) side completed and had acknowledged
    bytes_sent: int = 0
    push_seconds: float = 0.0  # summed wall time of completed pushes (latency = /pushes_sent)
    pushes_received: int = 0  # pushes accepted into a reserved slot
    bytes_received: int = 0
    rejected_pushes: int = 0  # pushes refused: unreserved, duplicate, wrong size/sender, expired
    timeouts: int = 0  # reservations released by a deadline or a wait timeout
    cancels: int = 0  # reservations released by `cancel`
    reclaimed: int = 0  # reservations released because their peer died
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **deltas: float) -> None:
        with self._lock:
            for name, delta in deltas.items():
                setattr(self, name, getattr(self, name) + delta)

    def snapshot(self) -> dict[str, float | str]:
        with self._lock:
            return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "_lock"}
