"""The mm-hash cache on a toy vision tower (Qwen2.5-VL's contract: patches + grid_thw in, merged
tokens out): per-image entries, hits that are the stored tensor itself, ownership (held entries are
never evicted), an entry that cannot fit is not stored, scope and tenant in the key, mismatched
token counts miss, calls it cannot key run uncached."""

from __future__ import annotations

import os

import pytest
import torch
from transformers.modeling_outputs import BaseModelOutputWithPooling

from triptych.mmcache.cache import MMCacheConfig, MMEmbeddingCache, holder_scope, install, tenant_scope
from triptych.mmcache.store import EmbeddingStore, checksum

DIM, OUT = 4, 8


class Toy(torch.nn.Module):
    """Per-patch linear, then 4 consecutive patches merged (spatial_merge_size 2), image by image."""

    spatial_merge_size = 2

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(DIM, OUT)
        self.calls = 0

    def forward(self, hidden_states, grid_thw, scale: float = 1.0, extra=None):
        self.calls += 1
        # One image at a time: a batched matmul may block the rows differently by batch size (a 1.5e-8
        # difference was seen), and these tests compare a batched call with each image alone exactly.
        sizes = [int(n) for n in grid_thw.prod(-1)]
        out = torch.cat([self.lin(x).reshape(-1, 4, OUT).mean(1) for x in hidden_states.split(sizes)]) * scale
        return BaseModelOutputWithPooling(last_hidden_state=hidden_states, pooler_output=out)


def image(seed: int, h: int = 2, w: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """(patches, grid row) of one toy image of h x w patches."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(h * w, DIM, generator=g), torch.tensor([1, h, w])


def call(enc, *images, **kw):
    pixels = torch.cat([p for p, _ in images])
    grid = torch.stack([g for _, g in images])
    return enc(pixels, grid_thw=grid, **kw).pooler_output


def test_a_hit_is_the_stored_tensor_itself_and_keys_cover_inputs_and_scope():
    enc = Toy()
    cache = install(enc, MMEmbeddingCache(1 << 20, scope="model-a"))
    a = image(1)
    first = call(enc, a)
    again = call(enc, (a[0].clone(), a[1].clone()))  # same bytes, other tensors: a hit
    assert enc.calls == 1 and again.data_ptr() == first.data_ptr()  # the same storage: no copy
    assert not again.requires_grad and again.is_contiguous()
    call(enc, a, scale=2.0)  # another keyword value: another key
    call(enc, image(1, 4, 2))  # another grid
    assert enc.calls == 3 and (cache.stats.hits, cache.stats.misses, cache.stats.forwards) == (1, 3, 3)
    other = Toy()
    install(other, MMEmbeddingCache(1 << 20, scope="model-b"))
    call(other, a)
    assert other.calls == 1  # a cache of another scope never serves this one's entries


def test_each_image_of_a_batched_call_is_its_own_entry_owning_its_storage():
    """A call of three images (one seen before, one twice) runs the two new ones in one forward;
    each stored embedding is a tensor of its own (not a view pinning the batch's output), and equals
    the image encoded alone."""
    enc = Toy()
    cache = install(enc, MMEmbeddingCache(1 << 20))
    a, b, c = image(1), image(2), image(3, 4, 2)
    call(enc, a)
    out = call(enc, a, b, c, b)
    assert enc.calls == 2 and cache.stats.forwards == 2 and len(cache) == 3
    entries = [e.tensor for e in cache.store._entries.values()]
    assert len({t.untyped_storage().data_ptr() for t in entries}) == 3
    assert all(t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in entries)
    alone = Toy()
    want = torch.cat([alone(p, g[None]).pooler_output for p, g in (a, b, c, b)])
    torch.testing.assert_close(out, want, rtol=0, atol=0)  # the toy sees images independently


def test_consumers_do_not_alter_a_stored_entry():
    """Qwen2.5-VL's own consumer (get_image_features + masked_scatter in the real model) reads the
    tower output out of place: after a chat-like use the entry's checksum is unchanged."""
    enc = Toy()
    cache = install(enc, MMEmbeddingCache(1 << 20))
    a = image(1)
    out = enc(*[a[0]], grid_thw=a[1][None])
    entry = next(iter(cache.store._entries.values())).tensor
    before = checksum(entry)
    out.pooler_output = torch.split(out.pooler_output, [1])  # what get_image_features does
    embeds = torch.cat(out.pooler_output)
    mask = torch.tensor([False, True, False])[:, None].expand(3, OUT)
    placed = torch.zeros(3, OUT).masked_scatter(mask, embeds)
    assert torch.equal(placed[1], entry[0])
    again = enc(a[0], grid_thw=a[1][None])  # a fresh container: the earlier caller's edit is not in it
    assert isinstance(again.pooler_output, torch.Tensor) and checksum(entry) == before


def test_held_entries_are_never_evicted_and_an_entry_that_cannot_fit_is_not_stored():
    store = EmbeddingStore(max_bytes=2 * 64)
    x, y, z = (torch.full((2, 8), float(i)) for i in range(3))  # 64 bytes each
    store.put("x", x, holder="r1")
    store.put("y", y)
    store.put("z", z)  # full: y (free, least recently used) goes, x (held) stays
    assert "x" in store and "y" not in store and store.stats.evictions == 1
    store.acquire("z", "r2")
    got = store.put("w", torch.ones(2, 8))  # both held: w runs but is not stored
    assert torch.equal(got, torch.ones(2, 8)) and "w" not in store and store.stats.not_stored == 1
    assert store.nbytes == 128 and store.stats.evictions == 1
    store.release("r1")
    store.put("w", torch.ones(2, 8))  # now x is free: it is evicted for w
    assert "x" not in store and "w" in store and store.holders("z") == {"r2"}
    store.release("r2")
    assert store.holder_count() == 0 and store.held() == 0


def test_hook_holds_entries_for_the_request_until_released():
    enc = Toy()
    cache = install(enc, MMEmbeddingCache(1 << 20))
    a = image(1)
    with holder_scope("req-1"):
        call(enc, a)
    (key,) = cache.store._entries
    assert cache.store.holders(key) == {"req-1"}
    cache.release("req-1")
    assert cache.store.holders(key) == frozenset() and cache.store.holder_count() == 0


def test_an_entry_with_another_token_count_is_a_miss_not_a_crash():
    store = EmbeddingStore(1 << 20)
    store.put("k", torch.ones(4, 8))
    assert store.get("k", tokens=3) is None and store.stats.misses == 1
    assert store.get("k", tokens=4) is not None and store.stats.hits == 1


def test_a_placeholder_count_that_differs_from_the_embeddings_is_an_error_naming_both():
    from triptych.mmcache.cache import check_placeholders

    embeds = torch.zeros(16, 8)
    assert check_placeholders(16, embeds) is embeds
    with pytest.raises(ValueError, match="12 image placeholder tokens but its images' embeddings have 16 rows"):
        check_placeholders(12, embeds)


def test_unkeyable_calls_bypass():
    enc = Toy()
    cache = install(enc, MMEmbeddingCache(1 << 20))
    a = image(1)
    call(enc, a, extra=[1, 2])  # a list argument cannot be keyed: runs uncached
    call(enc, a, extra=[1, 2])
    assert cache.stats.bypassed == 2 and enc.calls == 2 and len(cache) == 0


@pytest.mark.parametrize("bad", [-1, float("nan"), float("inf"), "256", True])
def test_config_refuses_a_budget_that_is_not_a_finite_number_of_mib(bad):
    with pytest.raises(ValueError, match=f"max_mb={bad!r}" if isinstance(bad, (str, bool)) else "max_mb="):
        MMCacheConfig(max_mb=bad)


@pytest.mark.parametrize("field", ["step_images", "step_vision_tokens"])
def test_config_refuses_a_step_budget_below_one(field):
    with pytest.raises(ValueError, match=field):
        MMCacheConfig(**{field: 0})


def test_config_budget_in_bytes():
    assert MMCacheConfig().max_bytes == 256 << 20 and MMCacheConfig(max_mb=0.5).max_bytes == 1 << 19
    assert MMCacheConfig(max_mb=0).max_bytes == 0 and MMCacheConfig(processor_mb=1).processor_bytes == 1 << 20


def test_one_tenants_entry_never_serves_another_tenant():
    """The tenant of the request (``tenant_scope``, set by the encoder around each encode and chat)
    is part of every key: tenant B's identical image misses tenant A's entry, and hits its own."""
    enc = Toy()
    cache = install(enc, MMEmbeddingCache(1 << 20, scope="model-a"))
    a = image(1)
    with tenant_scope("tenant-a"):
        call(enc, a)
        call(enc, a)
    with tenant_scope("tenant-b"):
        call(enc, a)
        call(enc, a)
    call(enc, a)  # no tenant: the shared scope, its own entry
    assert enc.calls == 3 and (cache.stats.hits, cache.stats.misses) == (2, 3)


def test_a_request_reading_what_it_holds_is_not_counted_twice():
    store = EmbeddingStore(1 << 20)
    store.put("k", torch.ones(4, 8), holder="r1")
    store.get("k", 4, holder="r2")  # another request's lookup (the layer's, for r2): a hit
    store.get("k", 4)  # r1 or r2 reading it in its own call: already counted
    assert store.stats.hits == 1
    store.release("r1"), store.release("r2")
    store.get("k", 4)  # nobody holds it: a plain lookup, counted
    assert store.stats.hits == 2


def test_the_shared_directory_is_bounded_and_a_bad_or_other_shaped_file_is_a_miss(tmp_path):
    from triptych.mmcache.shared import SharedStore

    store = SharedStore(tmp_path, max_bytes=2 * 1024)
    for i, key in enumerate("abc"):
        store.save(key, torch.full((16, 8), float(i)))  # 512 bytes of data each, plus a header
        os.utime(tmp_path / f"{key}.safetensors", (i, i))  # a written order the filesystem keeps
    store.save("d", torch.zeros(16, 8))
    assert store.snapshot().nbytes <= 2 * 1024 and store.stats.evictions >= 1
    assert store.load("a", 16) is None  # the least recently written went first
    assert torch.equal(store.load("d", 16), torch.zeros(16, 8))
    assert store.load("d", 15) is None  # another token count: a miss
    (tmp_path / "e.safetensors").write_bytes(b"not a tensor file")
    assert store.load("e", 16) is None and store.stats.hits == 1


def test_processor_tier_is_lru_by_bytes_and_a_hit_refreshes_its_entry():
    from triptych.mmcache.processor import ProcessorCache

    def entry(i: int) -> tuple[torch.Tensor, torch.Tensor]:  # 16 + 8 = 24 bytes per entry
        return torch.full((1, 4), float(i)), torch.tensor([[1]], dtype=torch.int64)

    tier = ProcessorCache(max_bytes=3 * 24)
    for key in "abc":
        tier.put(key, *entry(ord(key)))
    assert tier.nbytes == 72 and len(tier) == 3 and tier.stats.evictions == 0
    assert tier.get("a")[0][0, 0].item() == ord("a")  # "a" is now the most recently used
    tier.put("d", *entry(ord("d")))  # one must go: the least recently used is "b"
    assert tier.get("b") is None and tier.get("a") is not None and tier.get("c") is not None
    assert tier.nbytes == 72 and tier.stats.evictions == 1
    tier.put("big", torch.zeros(1, 32), torch.zeros(1, 1, dtype=torch.int64))  # 136 bytes > 72: not stored
    assert tier.get("big") is None and tier.stats.not_stored == 1 and tier.nbytes == 72
    snap = tier.snapshot()
    assert (snap.entries, snap.nbytes, snap.hits, snap.misses) == (3, 72, 3, 2)
