"""The encoder layer on the packaged edit model, through the encoder runner (run via
``python benchmarks/mm_cache.py --encoder-layer [--soak 1000]``, or this file directly).

1. 8 concurrent requests with 8 distinct images, 4 chats (max_tokens 4) and 4 edits (CFG), all taken
   before the first step: vision-tower forwards with the layer (one batched forward per step) vs
   the layer off (each request's own calls, the mm-hash cache still on) vs no cache at all; and the
   largest difference of any output from the request alone on a cache-off encoder.
2. Two encoders: a chat about an image on one, then a chat about the same image: vision-tower forwards
   in total when the head sends the second where the first went (``control.affinity``) vs round robin,
   and round robin with the encoders sharing a directory of embeddings (``mmcache.shared``).
3. Soak: N chats (max_tokens 1) about images drawn from 200 distinct ones, with a 0.25 MiB embedding
   budget (64 of the 200 fit) and a 2 MiB processor budget (about 27 fit): process RSS after the
   first tenth and at the end, the tiers' bytes, entries and
   evictions, and the references still held at the end (must be 0). Lookups count once per
   image of a request (the layer's; the request's own read of what it fetched is not counted).
"""

from __future__ import annotations

import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: tests.helpers

import psutil  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)
import transformers  # noqa: E402

transformers.logging.set_verbosity_error()

from shapeworld import render, sample_scenes  # noqa: E402
from tests.helpers import EncoderPort  # noqa: E402
from triptych.control import protocol as P  # noqa: E402
from triptych.control import wire  # noqa: E402
from triptych.control.affinity import ImageAffinity  # noqa: E402
from triptych.control.dispatch import Instance, RoundRobin  # noqa: E402
from triptych.families.base import GenerationParams, Role  # noqa: E402
from triptych.families.models import PACKAGED_DEFAULT  # noqa: E402
from triptych.families.registry import family_class  # noqa: E402
from triptych.mmcache.cache import MMCacheConfig  # noqa: E402
from triptych.worker.runners.encoder import EncoderRunner  # noqa: E402

MODEL = PACKAGED_DEFAULT.parent / "default_edit"


def load(**config):
    return family_class(MODEL)(MODEL, roles={Role.ENCODER}, mm_cache_config=MMCacheConfig(**config))


def chat_task(rid, image, max_tokens):
    parts = [P.ChatPart(image=0), P.ChatPart(text="What is in this image?")]
    return P.ChatTask(
        request_id=rid,
        generation=1,
        messages=[P.ChatMessage(role="user", parts=parts)],
        images_png=[wire.png_bytes(image)],
        max_tokens=max_tokens,
        temperature=0.0,
        top_p=1.0,
        seed=0,
        stream=False,
    )


def edit_task(family, rid, image):
    p = family.resolve(GenerationParams(prompt="make the shape red", image=image, seed=0))
    return P.EncodeTask(request_id=rid, generation=1, params=wire.params_to_wire(p), denoiser="den-0")


def drain(runner):
    while runner.has_work():
        runner.execute()
    assert not runner.port.failed, runner.port.failed


def forwards_of(family):
    return 0 if family.mm_cache is None else family.mm_cache.stats.forwards


def outputs(runner):
    chats = {m.request_id: m.text for m in runner.port.sent if isinstance(m, P.ChatDone)}
    edits = {rid: job.outgoing for rid, job in runner.port.jobs.items() if job.outgoing is not None}
    return chats, edits


def eight_mixed(pics, family, batched: bool, plain_visual_calls: list | None = None):
    runner = EncoderRunner(family, EncoderPort(keep_deltas=False))
    if not batched:
        runner.layer = None
    before = forwards_of(family)
    for i, image in enumerate(pics):
        runner.accept(chat_task(f"c{i}", image, 4) if i % 2 else edit_task(family, f"e{i}", image))
    drain(runner)
    return forwards_of(family) - before, outputs(runner)


def count_tower_calls(family):
    calls = []
    visual = family.pipe.text_encoder.model.visual
    handle = visual.patch_embed.register_forward_pre_hook(lambda *a: calls.append(1))
    return calls, handle


def main(soak: int = 1000) -> int:
    print(f"load average {os.getloadavg()[0]:.2f}; packaged edit model (vision tower of the default_edit)\n")
    pics = [render(s, 64) for s in sample_scenes(8, "bench-encoder-layer", "heldout")]
    layered, own, off = load(), load(), load(max_mb=0)
    n_layer, (chats, edits) = eight_mixed(pics, layered, batched=True)
    n_own, _ = eight_mixed(pics, own, batched=False)
    calls, handle = count_tower_calls(off)
    _, (want_chats, want_edits) = eight_mixed(pics, off, batched=False)
    handle.remove()
    diff = max(float((edits[k][n] - want_edits[k][n]).abs().max()) for k in edits for n in edits[k])
    print("| 8 concurrent requests, 8 distinct images (4 chats, 4 edits with CFG) | vision-tower forwards |")
    print("|---|---|")
    print(f"| encoder layer (batched per step) | {n_layer} |")
    print(f"| mm-hash cache, each request's own calls | {n_own} |")
    print(f"| no cache | {len(calls)} |")
    print(
        f"\nlargest difference from each request alone: edits {diff:g} (conditioning tensors), "
        f"chats {'equal' if chats == want_chats else 'DIFFERENT'} (answers)\n"
    )
    two = {}
    shared = tempfile.mkdtemp(prefix="triptych-shared-")
    for mode in ("affinity", "round robin", "round robin, shared directory"):
        extra = {"shared_dir": shared} if "shared" in mode else {}
        fams = {"enc-a": load(**extra), "enc-b": load(**extra)}
        insts = [Instance(i, "encoder", 2, i, "", "zmq", 0, 0.0) for i in fams]
        aff, rr = ImageAffinity(), RoundRobin()
        image = pics[0]
        for rid in ("q1", "q2"):
            keys = aff.keys("", [image])
            inst = (aff.prefer(keys, insts) if mode == "affinity" else None) or rr.pick(insts)
            aff.record(keys, inst.instance_id)
            runner = EncoderRunner(fams[inst.instance_id], EncoderPort(keep_deltas=False))
            runner.accept(chat_task(rid, image, 1))
            drain(runner)
        two[mode] = sum(forwards_of(f) for f in fams.values())
    shutil.rmtree(shared, ignore_errors=True)
    print("| two encoders, two chats about one image | vision-tower forwards in total |")
    print("|---|---|")
    for mode, n in two.items():
        print(f"| head {mode} | {n} |")
    print()
    fam = load(max_mb=0.25, processor_mb=2)
    runner = EncoderRunner(fam, EncoderPort(keep_deltas=False))
    pool = [render(s, 64) for s in sample_scenes(200, "bench-encoder-soak", "heldout")]
    rng = random.Random(0)
    proc = psutil.Process()
    rss = []
    start = time.monotonic()
    peak_bytes = 0
    for i in range(soak):
        runner.accept(chat_task(f"s{i}", rng.choice(pool), 1))
        drain(runner)
        runner.port.sent.clear()
        peak_bytes = max(peak_bytes, fam.mm_cache.nbytes)
        if i + 1 in (soak // 10, soak):
            rss.append(proc.memory_info().rss / 2**20)
    snap = fam.mm_cache.snapshot()
    held = fam.mm_cache.store.holder_count()
    print(
        f"soak: {soak} chats (max_tokens 1) about 200 distinct images, 0.25 MiB embedding + 2 MiB processor budgets, {time.monotonic() - start:.0f} s"
    )
    print(
        f"| RSS after {soak // 10} | RSS after {soak} | embedding bytes (peak / budget) | entries | evictions | hits / misses | processor tier bytes / hits / misses / evictions | references held at the end |"
    )
    print("|---|---|---|---|---|---|---|---|")
    print(
        f"| {rss[0]:.0f} MiB | {rss[1]:.0f} MiB | {peak_bytes} / {fam.mm_cache.max_bytes} | {snap.entries} | "
        f"{snap.evictions} | {snap.hits} / {snap.misses} | {snap.processor.nbytes} / {snap.processor.hits} / {snap.processor.misses} / {snap.processor.evictions} | {held} |"
    )
    ok = (
        n_layer <= 2
        and chats == want_chats
        and diff == 0
        and two["affinity"] == 1
        and two["round robin, shared directory"] == 1
        and held == 0
    )
    return 0 if ok and peak_bytes <= fam.mm_cache.max_bytes else 1


if __name__ == "__main__":
    raise SystemExit(main(int(sys.argv[1]) if len(sys.argv) > 1 else 1000))
