"""Cross-encoder embedding hits (``worker.mm_remote``) between two in-process encoders on the toy
vision tower, over real ZMQ transfer endpoints on loopback: a hinted miss is fetched instead of
computed (the same tensor, bytes counted); a lent entry is held while it is read and released after;
every failure (entry gone, another token count, holder gone, another tenant) falls back to the tower
and is counted, and leaves no slot, hint or reference behind."""

from __future__ import annotations

import pytest
import torch

from tests.e2e.http_support import wait_for
from tests.unit.test_mm_cache import Toy, call, image
from triptych.control.mm_hints import MMHint
from triptych.mmcache.cache import MMEmbeddingCache, install
from triptych.transfer import TensorSpec, TransferConfig
from triptych.transfer.peer import PeerEndpoint
from triptych.worker.mm_remote import attach

CONFIG = TransferConfig(poll_interval_s=0.01)  # one token for every encoder


class Encoder:
    def __init__(self, name: str, timeout_s: float = 5.0):
        self.enc = Toy()
        self.cache = install(self.enc, MMEmbeddingCache(1 << 20, scope="toy"))
        self.endpoint = PeerEndpoint(name, CONFIG)
        self.remote = attach(self.cache, self.endpoint, timeout_s)

    def hint_for(self, key: str, tensor: torch.Tensor, tenant: str = "") -> MMHint:
        """What the head would send another encoder about this encoder's entry ``key``."""
        return MMHint(
            holder=self.endpoint.instance_id,
            address=self.endpoint.address,
            tenant=tenant,
            mm_hash=key,
            spec=TensorSpec.of(tensor),
        )

    def idle(self) -> bool:
        return self.endpoint.idle() and self.endpoint.lending.running == 0 and self.cache.store.holder_count() == 0


@pytest.fixture
def pair():
    a, b = Encoder("enc-a"), Encoder("enc-b", timeout_s=1.0)
    yield a, b
    a.endpoint.close()
    b.endpoint.close()


def encoded_on_a(a: Encoder, seed: int = 1):
    img = image(seed)
    out = call(a.enc, img)
    return img, out, a.cache.key(*img)


def test_a_hinted_miss_is_fetched_from_the_holder_instead_of_running_the_tower(pair):
    a, b = pair
    img, want, key = encoded_on_a(a)
    b.remote.hint("r1", "", [a.hint_for(key, want)])
    got = call(b.enc, img)
    assert b.enc.calls == 0 and torch.equal(got, want)  # the tower never ran on B
    stats = b.remote.snapshot()
    assert (stats.hits, stats.failures, stats.bytes) == (1, 0, want.numel() * want.element_size())
    wait_for(lambda: a.remote.snapshot().lent == 1 and a.idle(), "A's loan to end")
    assert key in b.cache.store and b.remote.hinted() == 0  # now local; the used hint is gone
    call(b.enc, img)
    assert b.enc.calls == 0 and b.cache.stats.hits == 1  # a local hit, no second fetch
    assert b.cache.snapshot().remote.hits == 1 and b.endpoint.idle()


def test_a_lent_entry_is_held_until_given_back_and_not_evicted_meanwhile(pair):
    a, b = pair
    _, want, key = encoded_on_a(a)
    ref = b.endpoint.reserve("t1", want.dtype, want.shape, "enc-a", 5.0)
    lent = a.remote.lend(key, ref, "loan-1")
    assert torch.equal(lent, want) and a.cache.store.holders(key) == {"loan-1"}
    a.cache.max_bytes = a.cache.nbytes  # no room left: a new entry would need the lent one evicted
    call(a.enc, image(2))
    assert key in a.cache.store and a.cache.stats.not_stored == 1
    a.remote.give_back("loan-1", pushed=False)
    assert a.cache.store.holders(key) == frozenset() and a.remote.snapshot().lend_failed == 1
    call(a.enc, image(3))
    assert key not in a.cache.store  # free again: evicted for the next entry
    b.endpoint.release("t1")


def test_an_entry_gone_from_the_holder_falls_back_to_the_tower_and_is_counted(pair):
    a, b = pair
    img, want, key = encoded_on_a(a)
    hint = a.hint_for(key, want)
    a.cache.max_bytes = a.cache.nbytes  # room for one entry
    call(a.enc, image(9))  # the next one evicts it (nobody holds it)
    assert key not in a.cache.store
    b.remote.hint("r1", "", [hint])
    got = call(b.enc, img)
    assert b.enc.calls == 1 and torch.equal(got, want)
    assert b.remote.snapshot().refused == 1 and b.remote.snapshot().hits == 0
    assert b.endpoint.idle() and a.idle()


def test_another_token_count_or_tenant_never_moves_a_byte(pair):
    a, b = pair
    img, want, key = encoded_on_a(a)
    hint = a.hint_for(key, want)
    wrong = MMHint(
        holder=hint.holder,
        address=hint.address,
        tenant="",
        mm_hash=key,
        spec=TensorSpec(hint.spec.dtype, (hint.tokens + 1, want.shape[1])),
    )
    b.remote.hint("r1", "", [wrong])
    assert torch.equal(call(b.enc, img), want) and b.enc.calls == 1
    assert b.remote.snapshot().tokens == 1 and a.endpoint.stats.snapshot().pushes_sent == 0
    other = Encoder("enc-c")
    try:
        other.remote.hint("r2", "tenant-b", [hint])  # the hint is tenant "": not for a tenant-b request
        assert other.remote.hinted() == 0
    finally:
        other.endpoint.close()


def test_a_holder_that_is_gone_falls_back_after_the_timeout_and_leaks_nothing(pair):
    a, b = pair
    img, want, key = encoded_on_a(a)
    hint = a.hint_for(key, want)
    a.endpoint.close()
    b.remote.hint("r1", "", [hint])
    assert torch.equal(call(b.enc, img), want) and b.enc.calls == 1
    assert b.remote.snapshot().unreachable == 1 and b.endpoint.idle()
    b.remote.forget("r1")
    assert b.remote.hinted() == 0 and b.cache.store.holder_count() == 0


def test_hints_are_dropped_with_the_request_that_carried_them(pair):
    a, b = pair
    _, want, key = encoded_on_a(a)
    b.remote.hint("r1", "", [a.hint_for(key, want)])
    b.remote.hint("r2", "", [a.hint_for(key, want)])
    b.remote.forget("r1")
    assert b.remote.hinted() == 1
    b.remote.forget("r2")
    assert b.remote.hinted() == 0
