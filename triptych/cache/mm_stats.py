"""Counters of the encoder layer's cache tiers (``cache.mm``): plain msgspec data, no torch.

``MMCacheStats`` is the embedding tier's (vision-tower outputs by mm-hash) and carries the other
tiers beside it: ``processor`` (image-processor outputs by media bytes, ``cache.mm_processor``) and
``prefix`` (chat prefix KV; filled in by the chat engine where it keeps one, None otherwise).
"""

from __future__ import annotations

import msgspec


class TierStats(msgspec.Struct):
    """One tier's counters (cumulative) and its size (levels)."""

    hits: int = 0
    misses: int = 0
    evictions: int = 0
    not_stored: int = 0  # entries that did not fit (the request ran; the entry was not kept)
    entries: int = 0  # a level, not a counter: a window keeps the latest
    nbytes: int = 0  # a level, like entries

    def since(self, prev: TierStats | None) -> TierStats:
        """The window from ``prev`` to this report: counter deltas, the levels as they are now."""
        if prev is None:
            return self
        return TierStats(
            hits=self.hits - prev.hits,
            misses=self.misses - prev.misses,
            evictions=self.evictions - prev.evictions,
            not_stored=self.not_stored - prev.not_stored,
            entries=self.entries,
            nbytes=self.nbytes,
        )


class MMCacheStats(msgspec.Struct):
    """The embedding tier's counters (cumulative) and its size (levels, filled in by ``snapshot``),
    plus the other tiers; sent to the head as it is inside a worker's stats report."""

    hits: int = 0
    misses: int = 0
    bypassed: int = 0  # calls the cache could not key (and ran as they are)
    evictions: int = 0
    entries: int = 0  # a level, not a counter: a window keeps the latest
    nbytes: int = 0  # a level, like entries
    not_stored: int = 0  # embeddings that did not fit beside the entries running requests hold
    forwards: int = 0  # vision-tower forwards run (a batched prefetch of many images counts one)
    held: int = 0  # a level: entries some running request holds (never evicted)
    processor: TierStats | None = None
    prefix: TierStats | None = None
    shared: TierStats | None = None  # the host's shared directory (``cache.mm_shared``), when configured

    def since(self, prev: MMCacheStats) -> MMCacheStats:
        """The window from ``prev`` to this report: counter deltas, the levels as they are now."""
        return MMCacheStats(
            hits=self.hits - prev.hits,
            misses=self.misses - prev.misses,
            bypassed=self.bypassed - prev.bypassed,
            evictions=self.evictions - prev.evictions,
            entries=self.entries,
            nbytes=self.nbytes,
            not_stored=self.not_stored - prev.not_stored,
            forwards=self.forwards - prev.forwards,
            held=self.held,
            processor=None if self.processor is None else self.processor.since(prev.processor),
            prefix=None if self.prefix is None else self.prefix.since(prev.prefix),
            shared=None if self.shared is None else self.shared.since(prev.shared),
        )

    def tiers(self) -> dict[str, TierStats]:
        """Every tier present, by name (``embedding``, ``processor``, ``prefix``, ``shared``)."""
        out = {
            "embedding": TierStats(self.hits, self.misses, self.evictions, self.not_stored, self.entries, self.nbytes)
        }
        for name in ("processor", "prefix", "shared"):
            tier = getattr(self, name)
            if tier is not None:
                out[name] = tier
        return out
