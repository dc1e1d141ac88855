"""Prefix KV for chats: the prompt KV of earlier chats, reused for the common start of a new one.

An entry is one prompt's KV (batch 1, every layer) under its key (``Prompt.key``: the tenant, then
each token's id, or for an image token its image's content hash). A token's KV depends only on the
tokens up to it (causal attention; positions come from the same prefix), so the KV of the first
``n`` tokens of any stored prompt is exact for any new prompt that starts with the same ``n`` key
items: five questions about one image pay the prefill of their own words only.

Entries are bounded by bytes and evicted least recently used, but only entries no running chat
holds (``acquire`` / ``release`` count the holders). Stored tensors are never written: a cache
that grows past them (``DynamicCache.update``) concatenates into new tensors. The LRU is hand-written
for that reason (held entries are skipped; ``mmcache/store.py`` says why ``cachetools`` does not fit).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from triptych.chat.kvbatch import KV, nbytes
from triptych.chat.stats import ChatEngineStats


@dataclass
class Entry:
    key: tuple
    kv: KV
    nbytes: int
    holders: int = 0


def common_prefix(a: tuple, b: tuple) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class PrefixCache:
    def __init__(self, max_bytes: int, stats: ChatEngineStats):
        self.max_bytes = max_bytes
        self.stats = stats
        self._entries: OrderedDict[tuple, Entry] = OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def longest(self, key: tuple) -> tuple[Entry | None, int]:
        """The entry sharing the longest start with ``key`` and that length in tokens (the tenant,
        ``key[0]``, must match; 0 tokens: no use)."""
        best, length = None, 0
        for entry in self._entries.values():
            if entry.key[0] != key[0]:
                continue
            n = common_prefix(entry.key, key) - 1  # the tenant is not a token
            if n > length:
                best, length = entry, n
        return best, length

    def acquire(self, entry: Entry) -> None:
        entry.holders += 1
        self._entries.move_to_end(entry.key)

    def release(self, entry: Entry) -> None:
        entry.holders -= 1

    def put(self, key: tuple, kv: KV) -> Entry | None:
        """Store ``kv`` under ``key`` (already there: the stored one is refreshed), evicting unheld
        entries as needed; None when it cannot fit beside the held ones."""
        if key in self._entries:
            self._entries.move_to_end(key)
            return self._entries[key]
        size = nbytes(kv)
        if size > self.max_bytes:
            return None
        for old in [e for e in self._entries.values() if e.holders == 0]:  # least recently used first
            if self._bytes + size <= self.max_bytes:
                break
            del self._entries[old.key]
            self._bytes -= old.nbytes
            self.stats.prefix_evictions += 1
        if self._bytes + size > self.max_bytes:
            return None
        entry = Entry(key, kv, size)
        self._entries[key] = entry
        self._bytes += size
        return entry

    def snapshot(self) -> None:
        self.stats.prefix_entries, self.stats.prefix_nbytes = len(self._entries), self._bytes
