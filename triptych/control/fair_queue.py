"""The head's waiting queues: priority classes, and fair shares between tenants inside a class.

A request waits under the key ``(priority, start tag, arrival)``, smallest first:

- ``priority``: an integer, lower runs sooner (vLLM's convention); a class is served strictly
  before every class behind it.
- ``start tag``: start-time fair queueing inside a class. Each (class, tenant) keeps the finish tag
  of its last request; a new one starts at ``max(virtual time of the class, that finish tag)`` and
  finishes ``cost / weight`` later; the class's virtual time is the start tag of the request it
  last started. A tenant that floods the queue gets tags far ahead; another tenant arriving later
  starts at the class's virtual time, so it interleaves with the flood instead of waiting behind
  it. With every request costing 1, over any run of requests started from a class while tenants
  a and b both wait, ``|served_a / w_a - served_b / w_b| <= 1 / w_a + 1 / w_b``.
- ``arrival``: a counter; ties (one tenant, or equal tags) go first come, first served.

A request leaving to start (``take``) advances the virtual time and counts for its tenant in
``served`` (a retried request that starts again counts again); one leaving otherwise (a cancel,
``remove``) does not. ``readd`` puts a request back at the front of its class (a retry; retries
among themselves in arrival order).
Owned by one event loop; nothing here takes a lock.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True, order=True)
class QueueKey:
    priority: int
    start: float
    arrival: int


class FairQueue:
    def __init__(self) -> None:
        self._order: list[tuple[QueueKey, str]] = []  # sorted by key
        self._keys: dict[str, QueueKey] = {}  # every request added and not forgotten
        self._queued: set[str] = set()
        self._virtual: dict[int, float] = {}  # priority -> virtual time of the class
        self._finish: dict[tuple[int, str], float] = {}  # (priority, tenant) -> finish tag of its last
        self._arrivals = itertools.count()
        self._tenant: dict[str, str] = {}  # rid -> its tenant, while its key is kept
        self.served: Counter[str] = Counter()  # tenant -> requests started from this queue

    # ---- membership ---------------------------------------------------------------------------
    def add(self, rid: str, priority: int = 0, tenant: str = "", weight: float = 1.0, cost: float = 1.0) -> QueueKey:
        """Queue ``rid`` at its place (see the module docstring); ``weight`` > 0 is its tenant's share."""
        if rid in self._keys:
            raise ValueError(f"request {rid!r} is already queued")
        start = max(self._virtual.get(priority, 0.0), self._finish.get((priority, tenant), 0.0))
        self._finish[(priority, tenant)] = start + cost / weight
        key = QueueKey(priority, start, next(self._arrivals))
        self._keys[rid] = key
        self._tenant[rid] = tenant
        self._insert(rid, key)
        return key

    def readd(self, rid: str) -> None:
        """Back in the queue, at the front of its class (a retried request)."""
        if rid not in self._queued:
            key = self._keys[rid]
            self._keys[rid] = key = QueueKey(key.priority, -math.inf, key.arrival)
            self._insert(rid, key)

    def take(self, rid: str) -> None:
        """``rid`` leaves the queue to start: its class's virtual time moves up to its start tag."""
        key = self._keys[rid]
        self._drop(rid)
        self._virtual[key.priority] = max(self._virtual.get(key.priority, 0.0), key.start)
        self.served[self._tenant[rid]] += 1

    def remove(self, rid: str) -> None:
        """``rid`` leaves the queue without starting (cancelled, failed); its key is kept for ``readd``."""
        self._drop(rid)

    def forget(self, rid: str) -> None:
        """``rid`` ended: out of the queue and its key dropped."""
        self._drop(rid)
        self._keys.pop(rid, None)
        self._tenant.pop(rid, None)

    # ---- reading ------------------------------------------------------------------------------
    def key(self, rid: str) -> QueueKey:
        return self._keys[rid]

    def ahead(self, priority: int) -> list[str]:
        """The queued requests a new request of ``priority`` would wait behind at least (those of its
        class and the classes before it), in order."""
        return [rid for key, rid in self._order if key.priority <= priority]

    def __contains__(self, rid: object) -> bool:
        return rid in self._queued

    def __len__(self) -> int:
        return len(self._order)

    def __bool__(self) -> bool:
        return bool(self._order)

    def __iter__(self) -> Iterator[str]:
        return iter([rid for _, rid in self._order])  # a copy: callers take while iterating

    def __getitem__(self, index: int) -> str:
        return self._order[index][1]

    def _insert(self, rid: str, key: QueueKey) -> None:
        bisect.insort(self._order, (key, rid))
        self._queued.add(rid)

    def _drop(self, rid: str) -> None:
        if rid in self._queued:
            self._queued.discard(rid)
            key = self._keys[rid]
            index = bisect.bisect_left(self._order, (key, rid))
            del self._order[index]
