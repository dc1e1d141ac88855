"""The head's result cache: encoded outputs of finished generations, kept for exact repeats.

``ResultCache(capacity_bytes)`` maps a key (``result_key``: everything that determines the output
bytes, the tenant included) to the bytes a generation returned. Contract:

- The cache owns its entries: ``put`` stores the ``bytes`` object it is given (immutable, shared
  with nobody who could change it) and ``get`` hands the same object back; callers never see an
  entry change or disappear under them.
- Bounded in bytes: the stored bytes never exceed ``capacity_bytes``. ``put`` evicts least recently
  used entries (``get`` and ``put`` both count as a use) until the new one fits; an entry larger than
  the whole capacity is not stored (counted ``not_stored``) and evicts nothing. A second ``put`` of
  a key replaces its entry.
- Nothing else evicts: entries live until pushed out by newer ones or until the head process ends
  (the cache is memory only; a restarted head starts empty). ``capacity_bytes=0`` stores nothing.

Not thread-safe: the head calls it from its event loop only.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class ResultCacheStats:
    """Cumulative counters since the head started, and what the cache holds now."""

    hits: int
    misses: int
    bypassed: int  # lookups skipped: no seed, opted out (``result_cache: false``), or the cache is off
    evictions: int
    not_stored: int  # results larger than the whole capacity
    nbytes: int
    entries: int
    capacity_bytes: int


class ResultCache:
    """Least-recently-used map of key → output bytes, bounded by the bytes it holds (module docstring)."""

    def __init__(self, capacity_bytes: int):
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes={capacity_bytes!r}: must be >= 0 (0 disables)")
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[str, bytes] = OrderedDict()
        self.nbytes = 0
        self.hits = self.misses = self.bypassed = self.evictions = self.not_stored = 0

    @property
    def enabled(self) -> bool:
        return self.capacity_bytes > 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def get(self, key: str) -> bytes | None:
        """The stored bytes (now the most recently used entry), or None; counts a hit or a miss."""
        data = self._entries.get(key)
        if data is None:
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return data

    def bypass(self, lookups: int = 1) -> None:
        """Count lookups that were not made (see ``ResultCacheStats.bypassed``)."""
        self.bypassed += lookups

    def put(self, key: str, data: bytes) -> bool:
        """Store ``data`` under ``key``, evicting the least recently used entries until it fits;
        False (nothing evicted) when it is larger than the capacity."""
        size = len(data)
        if size > self.capacity_bytes:
            self.not_stored += 1
            return False
        old = self._entries.pop(key, None)
        if old is not None:
            self.nbytes -= len(old)
        while self.nbytes + size > self.capacity_bytes:
            _, evicted = self._entries.popitem(last=False)
            self.nbytes -= len(evicted)
            self.evictions += 1
        self._entries[key] = data
        self.nbytes += size
        return True

    def stats(self) -> ResultCacheStats:
        return ResultCacheStats(
            self.hits,
            self.misses,
            self.bypassed,
            self.evictions,
            self.not_stored,
            self.nbytes,
            len(self._entries),
            self.capacity_bytes,
        )
