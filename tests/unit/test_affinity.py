"""The head's image affinity map: bounded, tenant-scoped, keyed by pixels, preferring a free
instance that holds the most of a request's images, forgetting an instance that left."""

from __future__ import annotations

import numpy as np
from PIL import Image

from triptych.server.affinity import ImageAffinity
from triptych.server.dispatch import Instance


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
