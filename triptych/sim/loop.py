"""A virtual clock and its event queue: callbacks run in time order (ties in the order scheduled);
nothing waits on a real clock."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable


class EventLoop:
    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self.events = 0  # callbacks run

    def clock(self) -> float:
        """The virtual time (what the head's code reads instead of ``time.monotonic``)."""
        return self.now

    def at(self, t: float, fn: Callable[[], None]) -> None:
        """Run ``fn`` at virtual time ``t`` (not before now)."""
        heapq.heappush(self._heap, (max(t, self.now), next(self._seq), fn))

    def after(self, delay_s: float, fn: Callable[[], None]) -> None:
        self.at(self.now + delay_s, fn)

    def run(self, until: float = float("inf")) -> None:
        """Run callbacks in time order until none is left or the next is past ``until``."""
        heap = self._heap
        while heap and heap[0][0] <= until:
            t, _, fn = heapq.heappop(heap)
            self.now = t
            self.events += 1
            fn()
        self.now = max(self.now, until) if until != float("inf") else self.now

    def __len__(self) -> int:
        return len(self._heap)
