"""The encoder layer on the packaged edit model, through the encoder runner: 8 requests (chats and
edits mixed) with 8 distinct images run the vision tower once, each output equal to the request
alone; the per-step budget is round-robin; references are released on finish, failure, abort and
close; entries are not altered by their consumers; the processor tier keys by pixels, settings and
tenant."""

from __future__ import annotations

import pytest
import torch

from shapeworld import render, sample_scenes
from tests.helpers import EncoderPort as Port
from triptych.control import protocol as P
from triptych.control import wire
from triptych.families.base import GenerationParams, Role
from triptych.families.models import PACKAGED_DEFAULT
from triptych.families.registry import family_class
from triptych.mmcache.cache import MMCacheConfig
from triptych.mmcache.layer import EncoderLayer
from triptych.mmcache.store import checksum
from triptych.worker.runners.encoder import EncoderRunner

EDIT_MODEL = PACKAGED_DEFAULT.parent / "default_edit"


def load(**config):
    torch.set_num_threads(1)
    return family_class(EDIT_MODEL)(EDIT_MODEL, roles={Role.ENCODER}, mm_cache_config=MMCacheConfig(**config))


@pytest.fixture(scope="module")
def family():
    return load()


@pytest.fixture(scope="module")
def plain():
    return load(max_mb=0)


def images(n, name):
    return [render(scene, 64) for scene in sample_scenes(n, name, "heldout")]


def edit_task(family, rid, image, tenant=""):
    p = family.resolve(GenerationParams(prompt="make the shape red", image=image, seed=0, tenant=tenant))
    return P.EncodeTask(request_id=rid, generation=1, params=wire.params_to_wire(p), denoiser="den-0"), p


def chat_task(rid, pics, tenant="", max_tokens=4):
    parts = [P.ChatPart(image=i) for i in range(len(pics))] + [P.ChatPart(text="What is in this image?")]
    msgs = [P.ChatMessage(role="user", parts=parts)]
    return P.ChatTask(
        request_id=rid,
        generation=1,
        messages=msgs,
        images_png=[wire.png_bytes(im) for im in pics],
        max_tokens=max_tokens,
        temperature=0.0,
        top_p=1.0,
        seed=0,
        stream=False,
        ignore_eos=False,
        tenant=tenant,
    )


def drain(runner, limit=500):
    for _ in range(limit):  # a bound, not a timing: each execute does one unit of work
        if not runner.has_work():
            return
        runner.execute()
    raise AssertionError("the runner did not finish its work")


def test_eight_mixed_requests_run_the_tower_once_and_each_equals_it_alone(family, plain):
    pics = images(8, "encoder-layer-batch")
    runner = EncoderRunner(family, Port())
    stats = family.mm_cache.stats
    forwards, hits, misses = stats.forwards, stats.hits, stats.misses
    edits = {}
    for i, image in enumerate(pics):
        if i % 2:
            runner.accept(chat_task(f"chat-{i}", [image]))
        else:
            task, edits[f"edit-{i}"] = edit_task(family, f"edit-{i}", image)
            runner.accept(task)
    runner.execute()  # the first step: one batched forward over all 8 images, then one encode
    assert stats.forwards == forwards + 1
    sums = {key: checksum(e.tensor) for key, e in family.mm_cache.store._entries.items()}
    drain(runner)
    assert stats.forwards == forwards + 1  # every encode and chat found its image in the tier
    # one lookup per image (the layer's); the requests' own reads of what it fetched are not counted
    assert (stats.hits - hits, stats.misses - misses) == (0, 8)
    assert not runner.port.failed
    done = {m.request_id: m.text for m in runner.port.sent if isinstance(m, P.ChatDone)}
    for i, image in enumerate(pics):
        if i % 2:
            from triptych.chat import ChatParams, ChatTurn

            ask = ChatParams((ChatTurn("user", (0, "What is in this image?")),), (image,), max_tokens=4)
            assert done[f"chat-{i}"] == plain.chat_model().run(ask).text
        else:
            got = runner.port.jobs[f"edit-{i}"].outgoing
            want = plain.encode(edits[f"edit-{i}"]).flat()
            for name, tensor in want.items():
                # batching the tower changes nothing here: it sees each image on its own (windowed
                # attention within an image; its matmuls give each row the same sums): bit-identical
                torch.testing.assert_close(got[name], tensor, rtol=0, atol=0)
    assert all(checksum(e.tensor) == sums[k] for k, e in family.mm_cache.store._entries.items() if k in sums)
    assert family.mm_cache.store.holder_count() == 0 and runner.layer.pending() == 0


def test_the_step_budget_is_round_robin_across_requests(family):
    cache = family.mm_cache
    visual = family.pipe.text_encoder.model.visual
    layer = EncoderLayer(cache, visual, family.processor.image_processor, MMCacheConfig(step_images=4))
    many, one = images(8, "encoder-layer-budget"), images(1, "encoder-layer-budget-one")
    forwards = cache.stats.forwards
    layer.add("big", "", many)
    layer.add("small", "", one)
    assert layer.step() == 4  # big, small, big, big
    assert layer.ready("small") and not layer.ready("big") and cache.stats.forwards == forwards + 1
    assert layer.step() == 4 and not layer.ready("big")
    assert layer.step() == 1 and layer.ready("big") and cache.stats.forwards == forwards + 3
    assert cache.store.held() == 9  # every image's entry is held for its request until released
    layer.release("big"), layer.release("small")
    assert cache.store.holder_count() == 0


def test_references_are_released_on_failure_abort_and_close(family, monkeypatch):
    runner = EncoderRunner(family, Port())
    pics = images(3, "encoder-layer-lifecycle")
    task, _ = edit_task(family, "bad-edit", pics[0])
    runner.accept(task)
    runner.accept(chat_task("aborted", [pics[1]], max_tokens=50))
    runner.accept(chat_task("closed", [pics[2]], max_tokens=50))
    monkeypatch.setattr(family, "encode", lambda params: (_ for _ in ()).throw(ValueError("boom")))
    runner.execute()  # prefetch all three, then the edit fails
    assert [rid for rid, _, _ in runner.port.failed] == ["bad-edit"]
    assert family.mm_cache.store.holder_count() == 2  # the two chats still hold their images
    runner.execute()  # the first chat starts
    runner.abort(runner.port.jobs["aborted"])
    assert family.mm_cache.store.holder_count() == 1
    runner.close()
    assert family.mm_cache.store.holder_count() == 0 and runner.layer.pending() == 0


def test_the_processor_tier_keys_by_pixels_settings_and_tenant(family):
    from triptych.mmcache import processor as mm_processor
    from triptych.mmcache.cache import tenant_scope

    ip = family.processor.image_processor
    tier = mm_processor.cache_of(ip)
    a, b = images(2, "encoder-layer-processor")
    first = ip(a, return_tensors="pt")
    hits, misses = tier.stats.hits, tier.stats.misses
    again = ip(a.copy(), return_tensors="pt")  # the same pixels, another object (another "name")
    assert (tier.stats.hits, tier.stats.misses) == (hits + 1, misses)
    assert again["pixel_values"] is first["pixel_values"] or torch.equal(again["pixel_values"], first["pixel_values"])
    changed = a.copy()
    changed.putpixel((0, 0), (255 - a.getpixel((0, 0))[0], 0, 0))
    ip(changed, return_tensors="pt")  # other pixels: a miss
    with tenant_scope("tenant-b"):
        ip(a, return_tensors="pt")  # another tenant: a miss
    ip(a, return_tensors="pt", do_normalize=False)  # other settings: a miss
    assert tier.stats.misses == misses + 3
    both = ip([a, b], return_tensors="pt")
    uncached = mm_processor._CACHES.pop(ip)
    try:
        want = ip([a, b], return_tensors="pt")
    finally:
        mm_processor._CACHES[ip] = uncached
    assert torch.equal(both["pixel_values"], want["pixel_values"]) and torch.equal(
        both["image_grid_thw"], want["image_grid_thw"]
    )
    assert 0 < tier.nbytes <= tier.max_bytes and type(ip).__name__ == "Qwen2VLImageProcessorPil"


def test_two_encoders_sharing_a_directory_run_the_tower_once_per_image_and_tenant(tmp_path):
    """An image chatted about on encoder A and then on encoder B (the same model, one host,
    ``shared_dir``): B reads A's embedding instead of running its tower, and answers the same; another
    tenant's identical image is its own key and runs the tower."""
    from triptych.chat import ChatParams, ChatTurn

    a, b = load(shared_dir=str(tmp_path)), load(shared_dir=str(tmp_path))
    (image,) = images(1, "encoder-layer-shared")

    def ask(tenant=""):
        return ChatParams((ChatTurn("user", (0, "What is in this image?")),), (image,), max_tokens=3, tenant=tenant)

    first = a.chat_model().run(ask())
    assert (a.mm_cache.stats.forwards, b.mm_cache.stats.forwards) == (1, 0)
    again = b.chat_model().run(ask())
    assert b.mm_cache.stats.forwards == 0 and b.mm_cache.shared.stats.hits == 1 and again.text == first.text
    b.chat_model().run(ask("tenant-b"))
    assert b.mm_cache.stats.forwards == 1
    shared = b.mm_cache.snapshot().shared
    assert shared.entries == 2 and 0 < shared.nbytes <= b.mm_cache.shared.max_bytes


def test_the_vision_token_budget_bounds_a_step_and_an_image_over_it_still_runs(family):
    cache = family.mm_cache
    visual = family.pipe.text_encoder.model.visual
    pics = images(5, "encoder-layer-token-budget")  # 16 vision tokens each with the packaged processor
    layer = EncoderLayer(cache, visual, family.processor.image_processor, MMCacheConfig(step_vision_tokens=40))
    layer.add("r", "", pics)
    assert [layer.step(), layer.step(), layer.step()] == [2, 2, 1] and layer.ready("r")
    tiny = EncoderLayer(cache, visual, family.processor.image_processor, MMCacheConfig(step_vision_tokens=1))
    tiny.add("s", "", pics[:2])
    assert [tiny.step(), tiny.step()] == [1, 1] and tiny.ready("s")  # one image per step, never none
    layer.release("r"), tiny.release("s")
