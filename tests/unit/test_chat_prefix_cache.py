"""The chat prefix KV cache's bookkeeping: longest common start per tenant, a byte budget, LRU
eviction of entries no running chat holds, and held entries never evicted."""

from __future__ import annotations

import torch

from triptych.chat.prefix import PrefixCache
from triptych.chat.stats import ChatEngineStats

LAYER_BYTES = 2 * 4 * 10 * 4  # keys + values, 10 tokens of 4 float32 values each


def kv(tokens=10):
    return [(torch.zeros(1, 1, tokens, 4), torch.zeros(1, 1, tokens, 4))]


def test_longest_common_start_within_the_tenant():
    cache = PrefixCache(10 * LAYER_BYTES, ChatEngineStats())
    cache.put(("t", 1, 2, 3, "img", 5), kv())
    cache.put(("t", 1, 2, 9), kv())
    entry, n = cache.longest(("t", 1, 2, 3, "img", 7))
    assert n == 4 and entry.key == ("t", 1, 2, 3, "img", 5)
    assert cache.longest(("t", 1, 2, 3, "other", 5))[1] == 3  # another image: the match stops at it
    assert cache.longest(("u", 1, 2, 3, "img", 5)) == (None, 0)  # another tenant


def test_only_entries_nobody_holds_are_evicted_least_recent_first():
    stats = ChatEngineStats()
    cache = PrefixCache(2 * LAYER_BYTES, stats)
    a, b = cache.put(("t", 1), kv()), cache.put(("t", 2), kv())
    cache.acquire(a)  # a running chat uses it (and it becomes the most recently used)
    assert cache.put(("t", 3), kv()) is not None
    assert [e.key for e in cache._entries.values()] == [("t", 1), ("t", 3)] and stats.prefix_evictions == 1
    cache.acquire(cache.longest(("t", 3))[0])
    assert cache.put(("t", 4), kv()) is None  # everything stored is held: the new one is not kept
    assert len(cache) == 2 and cache.nbytes == 2 * LAYER_BYTES
    cache.release(a)
    assert cache.put(("t", 4), kv()) is not None and cache.longest(("t", 1)) == (None, 0)
    assert b.holders == 0 and cache.put(("t", 5), kv(tokens=30)) is None  # larger than the whole budget
