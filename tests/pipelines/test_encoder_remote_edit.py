"""Cross-encoder hits for image-conditioned generation (``worker.mm_remote``), through two encoder
runners of the packaged edit model with their own ZMQ endpoints on loopback: an edit encoded on A
reports its image's embedding (``EncodeDone.images``); the same edit on B, carrying the hint the head
builds from that report, fetches it from A instead of running B's tower, and B's conditioning is
bit-identical to an encoder without any cache."""

from __future__ import annotations

import pytest
import torch

from tests.e2e.http_support import wait_for
from tests.helpers import EncoderPort
from tests.pipelines.test_encoder_layer import drain, edit_task, images, load
from triptych.control import protocol as P
from triptych.control.affinity import ImageAffinity
from triptych.transfer import TransferConfig
from triptych.transfer.peer import PeerEndpoint
from triptych.worker.mm_remote import attach
from triptych.worker.runners.encoder import EncoderRunner

CONFIG = TransferConfig()  # one token for both sides


class Side:
    def __init__(self, name: str):
        self.family = load()
        self.endpoint = PeerEndpoint(name, CONFIG)
        self.remote = attach(self.family.mm_cache, self.endpoint, 10.0)
        self.port = EncoderPort()
        self.port.instance_id = name
        self.runner = EncoderRunner(self.family, self.port)


@pytest.fixture
def sides():
    a, b = Side("enc-a"), Side("enc-b")
    yield a, b
    a.endpoint.close()
    b.endpoint.close()


def test_an_edit_encoded_on_one_encoder_is_a_remote_hit_on_the_other(sides):
    a, b = sides
    plain = load(max_mb=0)
    (image,) = images(1, "encoder-remote-edit")
    task, params = edit_task(a.family, "e1", image)
    a.runner.accept(task)
    drain(a.runner)
    (done,) = [m for m in a.port.sent if isinstance(m, P.EncodeDone)]
    assert len(done.images) == 1 and a.family.mm_cache.stats.forwards == 1
    affinity = ImageAffinity()  # what the head does with the report, then with the next request
    keys = affinity.keys("", [params.image])
    affinity.held(keys, "enc-a", done.images)
    hints = affinity.hints(keys, "enc-b", {"enc-a": a.endpoint.address, "enc-b": b.endpoint.address})
    again, _ = edit_task(b.family, "e2", image)
    b.runner.accept(
        P.EncodeTask(
            request_id=again.request_id,
            generation=again.generation,
            params=again.params,
            denoiser=again.denoiser,
            mm_hints=hints,
        )
    )
    drain(b.runner)
    assert b.family.mm_cache.stats.forwards == 0 and b.remote.snapshot().hits == 1
    got = b.port.jobs["e2"].outgoing
    for name, tensor in plain.encode(params).flat().items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=0)  # bit-identical: the same bytes moved
    assert b.remote.hinted() == 0 and b.family.mm_cache.store.holder_count() == 0
    wait_for(lambda: a.remote.snapshot().lent == 1, "A's loan to end")  # its push thread ends after B has the bytes
    assert a.family.mm_cache.store.holder_count() == 0
