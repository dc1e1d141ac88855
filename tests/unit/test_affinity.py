"""The head's image affinity map: bounded, tenant-scoped, keyed by pixels, preferring a free
instance that holds the most of a request's images, forgetting an instance that left."""

from __future__ import annotations

import numpy as np
from PIL import Image

from triptych.control.affinity import ImageAffinity
from triptych.control.dispatch import Instance


def instance(iid: str, capacity: int = 2) -> Instance:
    return Instance(iid, "encoder", capacity, iid, "tcp://127.0.0.1:1", "zmq", 1, 0.0)


def picture(seed: int):
    return Image.fromarray((np.random.RandomState(seed).rand(8, 8, 3) * 255).astype("uint8"))


def test_prefers_the_free_holder_of_most_images_per_tenant():
    a, b = instance("enc-a"), instance("enc-b")
    aff = ImageAffinity()
    one, two, three = picture(1), picture(2), picture(3)
    aff.record(aff.keys("t", [one]), "enc-a")
    aff.record(aff.keys("t", [two, three]), "enc-b")
    assert aff.prefer(aff.keys("t", [one.copy()]), [a, b]) is a  # the same pixels, another object
    assert aff.prefer(aff.keys("t", [one, two, three]), [a, b]) is b  # b holds two of the three
    assert aff.prefer(aff.keys("other", [one]), [a, b]) is None  # another tenant's key
    a.hold("r1"), a.hold("r2")
    assert aff.prefer(aff.keys("t", [one]), [a, b]) is None  # the holder is full: the policy chooses
    assert aff.prefer(aff.keys("t", [two]), [a, b], exclude=frozenset({"enc-b"})) is None
    aff.forget("enc-b")
    assert aff.prefer(aff.keys("t", [two]), [a, b]) is None and len(aff) == 1


def test_the_map_is_bounded_oldest_first():
    aff = ImageAffinity(most=2)
    pics = [picture(i) for i in range(3)]
    for p in pics:
        aff.record(aff.keys("t", [p]), "enc-a")
    assert len(aff) == 2 and aff.prefer(aff.keys("t", [pics[0]]), [instance("enc-a")]) is None


def test_a_new_record_refreshes_an_image_a_lookup_does_not():
    aff = ImageAffinity(most=2)
    pics = [picture(i) for i in range(4)]
    aff.record(aff.keys("t", [pics[0]]), "enc-a")
    aff.record(aff.keys("t", [pics[1]]), "enc-b")
    aff.record(aff.keys("t", [pics[0]]), "enc-a")  # recorded again: now the newest
    aff.record(aff.keys("t", [pics[2]]), "enc-a")  # forgets pics[1], the oldest record
    a, b = instance("enc-a"), instance("enc-b")
    assert aff.prefer(aff.keys("t", [pics[1]]), [a, b]) is None
    assert aff.prefer(aff.keys("t", [pics[0]]), [a, b]) is a  # a lookup, not a record: pics[0] stays oldest
    aff.record(aff.keys("t", [pics[3]]), "enc-b")  # forgets pics[0]
    assert aff.prefer(aff.keys("t", [pics[0]]), [a, b]) is None and aff.prefer(aff.keys("t", [pics[2]]), [a, b]) is a


def test_hints_name_another_live_holder_of_the_reported_embeddings_within_the_tenant():
    from triptych.control.mm_hints import MMImage
    from triptych.transfer import TensorSpec

    aff = ImageAffinity()
    one, two = picture(1), picture(2)
    emb = MMImage(mm_hash="h1", spec=TensorSpec("float32", (16, 64)))
    addresses = {"enc-a": "tcp://127.0.0.1:5001", "enc-b": "tcp://127.0.0.1:5002"}
    aff.held(aff.keys("t", [one]), "enc-a", (emb,))
    (hint,) = aff.hints(aff.keys("t", [one.copy(), two]), "enc-b", addresses)
    assert (hint.holder, hint.address, hint.tenant, hint.mm_hash, hint.tokens) == (
        "enc-a",
        "tcp://127.0.0.1:5001",
        "t",
        "h1",
        16,
    )
    assert aff.hints(aff.keys("t", [one]), "enc-a", addresses) == ()  # the holder itself needs none
    assert aff.hints(aff.keys("other", [one]), "enc-b", addresses) == ()  # another tenant's key
    assert aff.hints(aff.keys("t", [one]), "enc-b", {"enc-b": "x"}) == ()  # the holder is not registered
    aff.held(aff.keys("t", [two]), "enc-b", ())  # reported nothing: remembers nothing
    assert aff.hints(aff.keys("t", [two]), "enc-a", addresses) == ()
    aff.forget("enc-a")
    assert aff.hints(aff.keys("t", [one]), "enc-b", addresses) == ()
