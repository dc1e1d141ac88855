"""Counters of one transfer endpoint: one msgspec struct, counted in process and sent to the head.

Plain data: the worker sends a ``snapshot()`` inside ``StatsReport``; the head turns two
consecutive reports into a window with ``since``; a Prometheus exporter or a log line reads it.
"""

from __future__ import annotations

import threading

import msgspec

from triptych.core import buckets
from triptych.core.kinds import TransferKind

# NOTE: one lock for every endpoint's counters: increments are a few per transfer, never contended.
_LOCK = threading.Lock()


class TransferStats(msgspec.Struct, kw_only=True):
    """Monotonic counters of one endpoint (cumulative since it started, or a window's deltas)."""

    backend: TransferKind  # the backend running (ZMQ or MOONCAKE)
    pushes_sent: int = 0  # pushes this (sender) side completed and had acknowledged
    bytes_sent: int = 0
    push_seconds: float = 0.0  # summed wall time of completed pushes (latency = /pushes_sent)
    pushes_received: int = 0  # pushes accepted into a reserved slot
    bytes_received: int = 0
    rejected_pushes: int = 0  # requests refused, of every cause below and: unreserved, wrong size, expired
    unauthenticated: int = 0  # of those: no capability, a wrong or forged one, or an unreadable header
    replays_refused: int = 0  # of those: authentic, for a slot already filled or released (a replay)
    timeouts: int = 0  # reservations released by a deadline or a wait timeout
    reservations: int = 0  # slots reserved on this (receiver) side
    cancels: int = 0  # reservations released by `cancel`
    reclaimed: int = 0  # reservations released because their peer died
    #: completed pushes per latency bucket (``buckets.PUSH_SECONDS_BOUNDS``, then +Inf)
    push_buckets: list[int] = msgspec.field(default_factory=list)

    def add(
        self,
        *,
        pushes_received: int = 0,
        bytes_received: int = 0,
        rejected_pushes: int = 0,
        unauthenticated: int = 0,
        replays_refused: int = 0,
        timeouts: int = 0,
        reservations: int = 0,
        cancels: int = 0,
        reclaimed: int = 0,
    ) -> None:
        with _LOCK:
            self.pushes_received += pushes_received
            self.bytes_received += bytes_received
            self.rejected_pushes += rejected_pushes
            self.unauthenticated += unauthenticated
            self.replays_refused += replays_refused
            self.timeouts += timeouts
            self.reservations += reservations
            self.cancels += cancels
            self.reclaimed += reclaimed

    def count_push(self, nbytes: int, seconds: float) -> None:
        """One completed, acknowledged push of ``nbytes`` that took ``seconds``."""
        with _LOCK:
            self.pushes_sent += 1
            self.bytes_sent += nbytes
            self.push_seconds += seconds
            buckets.observe(self.push_buckets, buckets.PUSH_SECONDS_BOUNDS, seconds)

    def snapshot(self) -> TransferStats:
        """A consistent copy (the endpoint's threads keep counting into this one)."""
        with _LOCK:
            return msgspec.structs.replace(self, push_buckets=list(self.push_buckets))

    def since(self, prev: TransferStats) -> TransferStats:
        """The window from ``prev`` (an earlier snapshot of the same endpoint) to this one."""
        return TransferStats(
            backend=self.backend,
            pushes_sent=self.pushes_sent - prev.pushes_sent,
            bytes_sent=self.bytes_sent - prev.bytes_sent,
            push_seconds=self.push_seconds - prev.push_seconds,
            pushes_received=self.pushes_received - prev.pushes_received,
            bytes_received=self.bytes_received - prev.bytes_received,
            rejected_pushes=self.rejected_pushes - prev.rejected_pushes,
            unauthenticated=self.unauthenticated - prev.unauthenticated,
            replays_refused=self.replays_refused - prev.replays_refused,
            timeouts=self.timeouts - prev.timeouts,
            reservations=self.reservations - prev.reservations,
            cancels=self.cancels - prev.cancels,
            reclaimed=self.reclaimed - prev.reclaimed,
            push_buckets=buckets.since(self.push_buckets, prev.push_buckets),
        )
