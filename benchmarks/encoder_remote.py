"""Cross-encoder embedding hits on the default model: the latency of a remote hit vs a local miss.

Three in-process encoders of the packaged default model (``triptych/assets/default``), each with its
own ZMQ transfer endpoint on loopback and ``worker.mm_remote`` attached, driven through the encoder
runner as a worker drives it (one torch thread). Per image: encoder A answers a chat about it
(untimed; its ``ChatDone`` reports the embedding); then encoder B takes a chat about the same image
carrying the head's hint (A holds it) and encoder C the same chat without one. Timed: the
embedding itself (``MMEmbeddingCache.encode``: the fetch from A, or the vision tower) and the encoder
layer's whole step (that plus the image processor), B and C alternating which goes first, after
warm-up; medians over distinct images. Each answer is checked equal to A's, and the tower forwards
counted (B: 0).

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

from shapeworld import render, sample_scenes  # noqa: E402
from tests.helpers import EncoderPort  # noqa: E402
from triptych.control import protocol as P  # noqa: E402
from triptych.control import wire  # noqa: E402
from triptych.control.mm_hints import MMHint  # noqa: E402
from triptych.families.base import Role  # noqa: E402
from triptych.families.models import PACKAGED_DEFAULT  # noqa: E402
from triptych.families.registry import family_class  # noqa: E402
from triptych.mmcache.cache import MMCacheConfig  # noqa: E402
from triptych.transfer import TransferConfig  # noqa: E402
from triptych.transfer.peer import PeerEndpoint  # noqa: E402
from triptych.worker import mm_remote  # noqa: E402
from triptych.worker.runners.encoder import EncoderRunner  # noqa: E402

CONFIG = TransferConfig()  # one token for every encoder


class Encoder:
    def __init__(self, name: str):
        self.family = family_class(PACKAGED_DEFAULT)(
            PACKAGED_DEFAULT, roles={Role.ENCODER}, mm_cache_config=MMCacheConfig()
        )
        self.endpoint = PeerEndpoint(name, CONFIG)
        mm_remote.attach(self.family.mm_cache, self.endpoint, timeout_s=5.0)
        self.port = EncoderPort(keep_deltas=False)
        self.port.instance_id = name
        self.runner = EncoderRunner(self.family, self.port)
        self.encode_s: list[float] = []  # each MMEmbeddingCache.encode call's seconds
        cache, encode = self.family.mm_cache, self.family.mm_cache.encode

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return encode(*args, **kwargs)
            finally:
                self.encode_s.append(time.perf_counter() - start)

        cache.encode = timed

    def chat(self, rid: str, image, hints=()) -> tuple[float, float, P.ChatDone]:
        """(seconds of the embedding, of the layer step that encodes the image, the answer)."""
        parts = [P.ChatPart(image=0), P.ChatPart(text="What is in this image?")]
        task = P.ChatTask(
            request_id=rid,
            generation=1,
            messages=[P.ChatMessage(role="user", parts=parts)],
            images_png=[wire.png_bytes(image)],
            max_tokens=4,
            temperature=0.0,
            top_p=1.0,
            seed=0,
            stream=False,
            ignore_eos=True,
            tenant="",
            mm_hints=hints,
        )
        self.runner.accept(task)
        self.encode_s.clear()
        start = time.perf_counter()
        self.runner.layer.step()
        took = time.perf_counter() - start
        (embedding,) = self.encode_s
        while self.runner.has_work():
            self.runner.execute()
        assert not self.port.failed, self.port.failed
        (done,) = [m for m in self.port.sent if isinstance(m, P.ChatDone) and m.request_id == rid]
        return embedding, took, done


def distinct(n: int) -> list:
    """``n`` scenes of distinct pixels (a repeat would be a local hit on both encoders)."""
    seen, out = set(), []
    for scene in sample_scenes(4 * n, "bench-encoder-remote", "heldout"):
        image = render(scene, 64)
        if image.tobytes() not in seen:
            seen.add(image.tobytes())
            out.append(image)
        if len(out) == n:
            return out
    raise SystemExit(f"only {len(out)} distinct scenes")


def main(n: int, warmup: int = 3) -> int:
    print(f"load average {os.getloadavg()[0]:.2f}; packaged default model, one torch thread\n")
    a, b, c = Encoder("enc-a"), Encoder("enc-b"), Encoder("enc-c")
    timings: dict[str, tuple[list, list]] = {"remote": ([], []), "local": ([], [])}
    same = True
    for i, image in enumerate(distinct(n + warmup)):
        _, _, held = a.chat(f"a{i}", image)
        hints = tuple(
            MMHint(holder="enc-a", address=a.endpoint.address, tenant="", mm_hash=im.mm_hash, spec=im.spec)
            for im in held.images
        )
        order = [(b, hints, "remote"), (c, (), "local")]
        for enc, h, mode in order if i % 2 else order[::-1]:
            embedding, step, done = enc.chat(f"x{i}", image, h)
            same = same and done.text == held.text
            if i >= warmup:
                timings[mode][0].append(embedding)
                timings[mode][1].append(step)
    stats = {name: e.family.mm_cache.snapshot() for name, e in (("A", a), ("B", b), ("C", c))}
    med = {mode: (statistics.median(e), statistics.median(s)) for mode, (e, s) in timings.items()}
    print(
        "| the image's embedding on a second encoder | embedding, median ms | layer step, median ms | tower forwards |"
    )
    print("|---|---|---|---|")
    for mode, label, who in (
        ("remote", "remote hit (fetched from A, peer to peer)", "B"),
        ("local", "local miss (its own vision tower)", "C"),
    ):
        print(f"| {label} | {med[mode][0] * 1e3:.2f} | {med[mode][1] * 1e3:.2f} | {stats[who].forwards} |")
    r = stats["B"].remote
    print(
        f"\nremote / local: embedding {med['remote'][0] / med['local'][0]:.2f}x, step "
        f"{med['remote'][1] / med['local'][1]:.2f}x over {n} images; remote hits {r.hits}, failures {r.failures}, "
        f"bytes moved {r.bytes} ({r.bytes // max(1, r.hits)} per image); A lent {stats['A'].remote.lent}; "
        f"answers {'equal' if same else 'DIFFERENT'} to A's"
    )
    for e in (a, b, c):
        e.endpoint.close()
    return 0 if same and stats["B"].forwards == 0 and r.hits == n + warmup == stats["C"].forwards else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, default=30)
    sys.exit(main(parser.parse_args().images))
