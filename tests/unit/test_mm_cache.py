"""The mm-hash cache on a toy encoder: exact hits, clones that protect entries, LRU by bytes, scope
in the key, and calls it cannot key run uncached."""

from __future__ import annotations

import pytest
import torch

from triptych.cache.mm import MMCacheConfig, MMEmbeddingCache, install


class Toy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 8)
        self.calls = 0

    def forward(self, x, grid=None, scale: float = 1.0, extra=None):
        self.calls += 1
        return {"out": self.lin(x) * scale}


def test_hits_are_exact_clones_and_keys_cover_inputs_and_scope():
    torch.manual_seed(0)
    enc = Toy()
    cache = install(enc, MMEmbeddingCache(1 << 20, scope="model-a"))
    x = torch.randn(3, 4)
    first = enc(x)
    again = enc(x.clone())  # same bytes, another tensor: a hit
    assert enc.calls == 1 and torch.equal(first["out"], again["out"])
    again["out"].add_(1.0)  # a caller altering its result does not alter the entry
    assert torch.equal(enc(x)["out"], first["out"]) and enc.calls == 1
    enc(x, scale=2.0)  # another keyword value: another key
    enc(x[:2])  # another shape
    assert enc.calls == 3 and (cache.stats.hits, cache.stats.misses) == (2, 3)
    other = Toy()
    other.load_state_dict(enc.state_dict())
    install(other, MMEmbeddingCache(1 << 20, scope="model-b"))
    other(x)
    assert other.calls == 1  # a cache of another scope never serves this one's entries


def test_lru_within_the_byte_budget_and_unkeyable_calls_bypass():
    enc = Toy()
    entry = 8 * 4  # one row of 8 float32 outputs
    cache = install(enc, MMEmbeddingCache(2 * entry))
    a, b, c = (torch.full((1, 4), float(i)) for i in range(3))
    enc(a), enc(b), enc(a)  # a is now the most recent
    enc(c)  # over budget: b (least recently used) goes
    assert cache.stats.evictions == 1 and len(cache) == 2 and cache.nbytes == 2 * entry
    calls = enc.calls
    enc(a), enc(c)
    assert enc.calls == calls  # both still cached
    enc(b)
    assert enc.calls == calls + 1  # b was evicted
    enc(a, extra=[1, 2])  # a list argument cannot be keyed: runs uncached
    assert cache.stats.bypassed == 1 and enc.calls == calls + 2
    tight = Toy()
    small = install(tight, MMEmbeddingCache(entry - 1))
    tight(a), tight(a)  # an output larger than the whole budget is never stored
    assert tight.calls == 2 and len(small) == 0 and small.nbytes == 0


@pytest.mark.parametrize("bad", [-1, float("nan"), float("inf"), "256", True])
def test_config_refuses_a_budget_that_is_not_a_finite_number_of_mib(bad):
    with pytest.raises(ValueError, match=f"max_mb={bad!r}" if isinstance(bad, (str, bool)) else "max_mb="):
        MMCacheConfig(max_mb=bad)


def test_config_budget_in_bytes():
    assert MMCacheConfig().max_bytes == 256 << 20 and MMCacheConfig(max_mb=0.5).max_bytes == 1 << 19
    assert MMCacheConfig(max_mb=0).max_bytes == 0


def test_one_tenants_entry_never_serves_another_tenant():
    """The tenant of the request (``tenant_scope``, set by the encoder around each encode and chat)
    is part of every key: tenant B's identical image misses tenant A's entry, and hits its own."""
    from triptych.cache.mm import tenant_scope

    enc = Toy()
    cache = install(enc, MMEmbeddingCache(1 << 20, scope="model-a"))
    x = torch.randn(3, 4)
    with tenant_scope("tenant-a"):
        enc(x)
        enc(x)
    with tenant_scope("tenant-b"):
        enc(x)
        enc(x)
    enc(x)  # no tenant: the shared scope, its own entry
    assert enc.calls == 3 and (cache.stats.hits, cache.stats.misses) == (2, 3)
