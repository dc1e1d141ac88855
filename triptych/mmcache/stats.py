"""Counters of the encoder layer's cache tiers (``mmcache.cache``): plain msgspec data, no torch.

``MMCacheStats`` is the embedding tier's (vision-tower outputs by mm-hash) and carries the other
tiers beside it: ``processor`` (image-processor outputs by media bytes, ``mmcache.processor``) and
``prefix`` (chat prefix KV; filled in by the chat engine where it keeps one, None otherwise).
"""

from __future__ import annotations

import msgspec


class TierStats(msgspec.Struct, kw_only=True):
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


class RemoteStats(msgspec.Struct, kw_only=True):
    """Embeddings moved between encoders over the transfer plane (``worker.mm_remote``), cumulative.

    The asking side: ``hits`` (a local miss the holder named in the head's hint pushed here instead
    of the tower running), ``bytes`` (what those moved), and the fetches that fell back to the tower:
    ``unreachable`` (no answer or no push in time: the holder is gone or slow), ``refused`` (the
    holder no longer has it, or not of that shape, or is busy), ``tokens`` (the hint's token count is
    not what this request needs). The lending side: ``lent`` (pushes to peers that completed) and
    ``lend_failed`` (pushes that failed or timed out; their reference was dropped all the same)."""

    hits: int = 0
    bytes: int = 0
    unreachable: int = 0
    refused: int = 0
    tokens: int = 0
    lent: int = 0
    lend_failed: int = 0

    @property
    def failures(self) -> int:
        return self.unreachable + self.refused + self.tokens

    def since(self, prev: RemoteStats | None) -> RemoteStats:
        if prev is None:
            return self
        fields = self.__struct_fields__
        return RemoteStats(**{f: getattr(self, f) - getattr(prev, f) for f in fields})


class MMCacheStats(msgspec.Struct, kw_only=True):
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
    shared: TierStats | None = None  # the host's shared directory (``mmcache.shared``), when configured
    remote: RemoteStats | None = None  # embeddings fetched from / lent to other encoders, when attached

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
            remote=None if self.remote is None else self.remote.since(prev.remote),
        )

    def tiers(self) -> dict[str, TierStats]:
        """Every tier present, by name (``embedding``, ``processor``, ``prefix``, ``shared``)."""
        out = {
            "embedding": TierStats(
                hits=self.hits,
                misses=self.misses,
                evictions=self.evictions,
                not_stored=self.not_stored,
                entries=self.entries,
                nbytes=self.nbytes,
            )
        }
        for name in ("processor", "prefix", "shared"):
            tier = getattr(self, name)
            if tier is not None:
                out[name] = tier
        return out
