"""Cross-encoder embedding hits on the default model: the latency of a remote hit vs a local miss.

Three in-process encoders of the packaged default model (``triptych/assets/default``), each with its
own ZMQ transfer endpoint on loopback and ``server.mm_remote`` attached, driven through the encoder
runner as a worker drives it (one torch thread). Per image: encoder A answers a chat about it
(untimed; its ``ChatDone`` reports the embedding); then encoder B takes a chat about the same image
carrying the head's hint (A holds it) and encoder C the same chat without one. Timed: the encoder
layer's step that produces the image's embedding (processor + either the fetch from A or the vision
tower), B and C alternating which goes first, after warm-up; medians over the images. Each answer
is checked equal to A's, and the tower forwards counted (B: 0).

    python benchmarks/encoder_remote.py [--images 30]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: tests.helpers

import torch  # noqa: E402

torch.set_num_threads(1)
import transformers  # noqa: E402

transformers.logging.set_verbosity_error()

from tests.helpers import EncoderPort  # noqa: E402
from triptych.cache.mm import MMCacheConfig  # noqa: E402
from triptych.models import PACKAGED_DEFAULT  # noqa: E402
from triptych.pipelines.base import Role  # noqa: E402
from triptych.pipelines.registry import family_class  # noqa: E402
from triptych.server import mm_remote, wire  # noqa: E402
from triptych.server import protocol as P  # noqa: E402
from triptych.server.mm_hints import MMHint  # noqa: E402
from triptych.server.runners.encoder import EncoderRunner  # noqa: E402
from triptych.server.transfer.peer import PeerEndpoint  # noqa: E402
from triptych.world import render, sample_scenes  # noqa: E402


class Encoder:
    def __init__(self, name: str):
        self.family = family_class(PACKAGED_DEFAULT)(
            PACKAGED_DEFAULT, roles={Role.ENCODER}, mm_cache_config=MMCacheConfig()
        )
        self.endpoint = PeerEndpoint(name)
        mm_remote.attach(self.family.mm_cache, self.endpoint, timeout_s=5.0)
        self.port = EncoderPort(keep_deltas=False)
        self.port.instance_id = name
        self.runner = EncoderRunner(self.family, self.port)

    def chat(self, rid: str, image, hints=()) -> tuple[float, P.ChatDone]:
        """(seconds of the layer step that encodes the image, the answer)."""
        parts = [P.ChatPart(image=0), P.ChatPart(text="What is in this image?")]
        task = P.ChatTask(
            rid, 1, [P.ChatMessage("user", parts)], [wire.png_bytes(image)], 4, 0.0, 1.0, 0, False, True, "", hints
        )
        self.runner.accept(task)
        start = time.perf_counter()
        self.runner.layer.step()
        took = time.perf_counter() - start
        while self.runner.has_work():
            self.runner.execute()
        assert not self.port.failed, self.port.failed
        (done,) = [m for m in self.port.sent if isinstance(m, P.ChatDone) and m.request_id == rid]
        return took, done


def main(n: int) -> int:
    print(f"load average {os.getloadavg()[0]:.2f}; packaged default model, one torch thread\n")
    a, b, c = Encoder("enc-a"), Encoder("enc-b"), Encoder("enc-c")
    pics = [render(s, 64) for s in sample_scenes(n + 3, "bench-encoder-remote", "heldout")]
    remote_s, local_s, same = [], [], True
    for i, image in enumerate(pics):
        _, held = a.chat(f"a{i}", image)
        hints = tuple(MMHint("enc-a", a.endpoint.address, "", im.mm_hash, im.spec) for im in held.images)
        order = [(b, hints, remote_s), (c, (), local_s)]
        for enc, h, out in order if i % 2 else order[::-1]:
            took, done = enc.chat(f"x{i}", image, h)
            same = same and done.text == held.text
            if i >= 3:  # warm-up
                out.append(took)
    stats = {name: e.family.mm_cache.snapshot() for name, e in (("A", a), ("B", b), ("C", c))}
    remote, local = statistics.median(remote_s), statistics.median(local_s)
    print("| the image's embedding on a second encoder | median ms (encoder-layer step) | vision-tower forwards |")
    print("|---|---|---|")
    print(f"| remote hit (fetched from A, peer to peer) | {remote * 1e3:.2f} | {stats['B'].forwards} |")
    print(f"| local miss (its own vision tower) | {local * 1e3:.2f} | {stats['C'].forwards} |")
    r = stats["B"].remote
    print(
        f"\nremote / local: {remote / local:.2f}x over {len(remote_s)} images; remote hits {r.hits}, failures "
        f"{r.failures}, bytes moved {r.bytes} ({r.bytes // max(1, r.hits)} per image); A lent {stats['A'].remote.lent}; "
        f"answers {'equal' if same else 'DIFFERENT'} to A's"
    )
    for e in (a, b, c):
        e.endpoint.close()
    return 0 if same and stats["B"].forwards == 0 and r.hits == n + 3 else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, default=30)
    sys.exit(main(parser.parse_args().images))
