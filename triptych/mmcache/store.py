"""The embedding tier's store: one owned tensor per mm-hash, and who is using it.

An entry is one image's vision-tower output (its own storage, ``requires_grad`` False). Entries are
held by the requests using them (``acquire`` / ``release`` by holder: the encoder runner's request
ids); only entries nobody holds are evicted, least recently used first, and only when a new entry
would not fit. When even evicting every free entry leaves no room, the new entry is not stored (the
request that computed it still gets it) and ``not_stored`` counts it.

A hit hands out the stored tensor itself, not a copy: entries are read-only by contract. Every
consumer in the serving path reads them out of place (transformers' Qwen2.5-VL splits and
concatenates the tower output, ``masked_scatter`` is out of place); ``checksum`` lets tests hold that.

Why the LRU here is hand-written (the processor tier's is ``cachetools``): a ``cachetools`` cache
evicts whatever its ``popitem`` names, one entry at a time, until the new one fits, and raises only
for an entry larger than the whole cache. This store must skip held entries and, when even every
free entry gone would not make room, evict nothing at all; neither is expressible there without
reaching into its private order.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from triptych.mmcache.stats import MMCacheStats


def nbytes_of(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def checksum(t: torch.Tensor) -> str:
    """SHA-256 of a tensor's bytes (tests: an entry nobody may alter still has its checksum)."""
    return hashlib.sha256(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()).hexdigest()


@dataclass
class _Entry:
    tensor: torch.Tensor
    nbytes: int
    holders: set[str] = field(default_factory=set)


class EmbeddingStore:
    """mm-hash → owned tensor, bounded by ``max_bytes``; held entries are never evicted."""

    def __init__(self, max_bytes: int, stats: MMCacheStats | None = None):
        if max_bytes < 0:
            raise ValueError(f"max_bytes={max_bytes}: must be >= 0 (0 disables the cache)")
        self.max_bytes = max_bytes
        self.stats = stats if stats is not None else MMCacheStats()
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # least recently used first
        self._held_by: dict[str, set[str]] = {}  # holder → keys it holds
        self._bytes = 0
        self.lock = threading.RLock()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    @property
    def nbytes(self) -> int:
        return self._bytes

    def get(self, key: str, tokens: int | None = None, holder: str | None = None) -> torch.Tensor | None:
        """The stored tensor (no copy; counted as a hit), or None (a miss, counted). An entry whose
        token count (first dimension) is not ``tokens`` is a miss: it was made for another input.
        A lookup outside any request (``holder`` None) of an entry running requests hold is one of
        them reading what the encoder layer fetched for it, already counted then: not counted again."""
        with self.lock:
            entry = self._entries.get(key)
            if entry is None or (tokens is not None and entry.tensor.shape[0] != tokens):
                self.stats.misses += 1
                return None
            self._entries.move_to_end(key)
            if holder is not None or not entry.holders:
                self.stats.hits += 1
            if holder is not None:
                self._hold(key, entry, holder)
            return entry.tensor

    def put(self, key: str, value: torch.Tensor, holder: str | None = None) -> torch.Tensor:
        """Store an owned copy of ``value`` (its own storage: a slice of a batch buffer does not pin
        the buffer) and return it; when it cannot fit, return ``value`` unstored (``not_stored``)."""
        with self.lock:
            present = self._entries.get(key)
            if present is not None and present.tensor.shape == value.shape:
                if holder is not None:
                    self._hold(key, present, holder)
                return present.tensor
            size = nbytes_of(value)
            if present is not None:  # another shape under this key (never in the hook's keys): replace
                self._drop(key)
            if not self._make_room(size):
                self.stats.not_stored += 1
                return value
            stored = value.detach().clone(memory_format=torch.contiguous_format)
            entry = _Entry(stored, size)
            self._entries[key] = entry
            self._bytes += size
            if holder is not None:
                self._hold(key, entry, holder)
            return stored

    def lend(self, key: str, tokens: int, holder: str) -> torch.Tensor | None:
        """The entry under ``key`` if it has ``tokens`` rows, held for ``holder`` (a peer's fetch:
        not counted as a lookup here); None when there is none of that size."""
        with self.lock:
            entry = self._entries.get(key)
            if entry is None or entry.tensor.shape[0] != tokens:
                return None
            self._hold(key, entry, holder)
            return entry.tensor

    def acquire(self, key: str, holder: str) -> bool:
        """``holder`` uses the entry under ``key`` (no-op and False when there is none)."""
        with self.lock:
            entry = self._entries.get(key)
            if entry is None:
                return False
            self._hold(key, entry, holder)
            return True

    def release(self, holder: str) -> None:
        """``holder`` (a finished, failed or aborted request) uses none of its entries any more."""
        with self.lock:
            for key in self._held_by.pop(holder, ()):
                entry = self._entries.get(key)
                if entry is not None:
                    entry.holders.discard(holder)

    def held_entry(self, key: str, holder: str) -> torch.Tensor | None:
        """The entry under ``key`` if ``holder`` holds it (not counted as a lookup), else None."""
        with self.lock:
            entry = self._entries.get(key)
            return entry.tensor if entry is not None and holder in entry.holders else None

    def holders(self, key: str) -> frozenset[str]:
        with self.lock:
            entry = self._entries.get(key)
            return frozenset() if entry is None else frozenset(entry.holders)

    def held(self) -> int:
        """Entries some request holds now."""
        with self.lock:
            return sum(1 for e in self._entries.values() if e.holders)

    def holder_count(self) -> int:
        """Requests holding any entry now (0 once every request released)."""
        with self.lock:
            return len(self._held_by)

    # ---- inside the lock --------------------------------------------------------------------
    def _hold(self, key: str, entry: _Entry, holder: str) -> None:
        entry.holders.add(holder)
        self._held_by.setdefault(holder, set()).add(key)

    def _make_room(self, size: int) -> bool:
        if size > self.max_bytes:
            return False
        free = self._bytes
        for entry in self._entries.values():
            if free + size <= self.max_bytes:
                break
            if not entry.holders:
                free -= entry.nbytes
        if free + size > self.max_bytes:
            return False  # even with every free entry gone it would not fit: evict nothing
        for key in [k for k, e in self._entries.items() if not e.holders]:
            if self._bytes + size <= self.max_bytes:
                break
            self._drop(key)
            self.stats.evictions += 1
        return True

    def _drop(self, key: str) -> None:
        entry = self._entries.pop(key)
        self._bytes -= entry.nbytes
        for holder in entry.holders:
            keys = self._held_by.get(holder)
            if keys is not None:
                keys.discard(key)
