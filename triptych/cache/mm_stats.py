"""Counters of the encoder's mm-hash cache (``cache.mm``): plain msgspec data, no torch."""

from __future__ import annotations

import msgspec


class MMCacheStats(msgspec.Struct):
    """The cache's counters (cumulative) and its size (levels, filled in by ``snapshot``); sent to the
    head as it is inside a worker's stats report."""

    hits: int = 0
    misses: int = 0
    bypassed: int = 0  # calls the cache could not key (and ran as they are)
    evictions: int = 0
    entries: int = 0  # a level, not a counter: a window keeps the latest
    nbytes: int = 0  # a level, like entries

    def since(self, prev: MMCacheStats) -> MMCacheStats:
        """The window from ``prev`` to this report: counter deltas, the levels as they are now."""
        return MMCacheStats(
            hits=self.hits - prev.hits,
            misses=self.misses - prev.misses,
            bypassed=self.bypassed - prev.bypassed,
            evictions=self.evictions - prev.evictions,
            entries=self.entries,
            nbytes=self.nbytes,
        )
