"""The head's result cache over HTTP (``HeadConfig.result_cache_mb``, the ``result_cache`` field).

A fake backend records every job it is given, so "no worker ran" is ``backend.jobs`` not growing;
one test runs the tiny FLUX model in an ``InProcessBackend`` for real output bytes.
"""

from __future__ import annotations

import base64
import json
import os
import re

import httpx
import numpy as np
import pytest

from tests.e2e.http_support import FakeBackend, FakeFamily, png_bytes, serve, wait_for
from triptych.control.backend import InProcessBackend
from triptych.families.registry import load_family
from triptych.head.app import HeadConfig, create_app

KEYS = ("tenant-a-key-000", "tenant-b-key-000")
A = {"Authorization": f"Bearer {KEYS[0]}"}
B = {"Authorization": f"Bearer {KEYS[1]}"}
BODY = {"prompt": "a red cube", "seed": 5, "num_inference_steps": 2, "size": "32x32", "guidance_scale": 3.0}


@pytest.fixture(scope="module")
def image_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("result-cache")
    backend = FakeBackend(FakeFamily(root / "model", accepts_image=True))
    config = HeadConfig(data_dir=root / "data", api_keys=KEYS, result_cache_mb=4)
    with serve(create_app(backend, config)) as base:
        yield base, backend


def post(base, body, headers=A, path="/v1/images/generations"):
    resp = httpx.post(f"{base}{path}", json=body, headers=headers, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp


def images(resp) -> list[bytes]:
    return [base64.b64decode(d["b64_json"]) for d in resp.json()["data"]]


def lookups(base) -> dict[str, float]:
    text = httpx.get(f"{base}/metrics").text
    return {m[0]: float(m[1]) for m in re.findall(r'triptych_result_cache_lookups_total\{result="(\w+)"\} (\S+)', text)}


def ran(backend, body, base, headers=A) -> int:
    """Jobs the backend was given for one request of ``body``."""
    before = len(backend.jobs)
    post(base, body, headers)
    return len(backend.jobs) - before


def test_a_seeded_repeat_is_answered_with_the_same_bytes_and_no_job(image_server):
    base, backend = image_server
    body = {**BODY, "prompt": "repeat me"}
    first = post(base, body)
    jobs, seen = len(backend.jobs), lookups(base)
    second = post(base, body)
    assert images(second) == images(first)
    assert len(backend.jobs) == jobs  # nothing was run the second time
    assert second.json()["seeds"] == [5]
    now = lookups(base)
    assert now["hit"] == seen["hit"] + 1 and now["miss"] == seen["miss"]
    assert float(re.search(r"^triptych_result_cache_bytes (\S+)", httpx.get(f"{base}/metrics").text, re.M)[1]) > 0


@pytest.mark.parametrize(
    "change",
    [
        {"prompt": "a blue cube"},
        {"seed": 6},
        {"num_inference_steps": 3},
        {"size": "48x32"},
        {"guidance_scale": 4.0},
        {"negative_prompt": "blurry"},
        {"true_cfg_scale": 2.0},
        {"output_format": "webp"},
    ],
    ids=lambda c: next(iter(c)),
)
def test_a_changed_parameter_misses(image_server, change):
    base, backend = image_server
    body = {**BODY, "prompt": f"changed {next(iter(change))}"}
    post(base, body)
    assert ran(backend, body, base) == 0
    assert ran(backend, {**body, **change}, base) == 1


def test_a_request_without_seed_is_never_answered_from_the_cache(image_server):
    base, backend = image_server
    body = {k: v for k, v in BODY.items() if k != "seed"}
    seen = lookups(base)
    assert ran(backend, body, base) == 1
    assert ran(backend, body, base) == 1
    now = lookups(base)
    assert now["bypassed"] == seen["bypassed"] + 2 and now["hit"] == seen["hit"]


def test_another_tenant_misses(image_server):
    base, backend = image_server
    body = {**BODY, "prompt": "tenant scoped"}
    post(base, body, A)
    assert ran(backend, body, base, A) == 0
    assert ran(backend, body, base, B) == 1
    assert ran(backend, body, base, B) == 0


def test_result_cache_false_neither_reads_nor_stores(image_server):
    base, backend = image_server
    body = {**BODY, "prompt": "opted out"}
    assert ran(backend, {**body, "result_cache": False}, base) == 1
    assert ran(backend, body, base) == 1  # the opted-out run was not stored
    assert ran(backend, {**body, "result_cache": False}, base) == 1  # nor is a stored one read
    assert ran(backend, {**body, "result_cache": True}, base) == 0


@pytest.mark.parametrize("value", ["no", 0, "true"])
def test_a_bad_result_cache_value_is_a_400_naming_the_field(image_server, value):
    base, backend = image_server
    resp = httpx.post(f"{base}/v1/images/generations", json={**BODY, "result_cache": value}, headers=A)
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == "result_cache"
    assert "result_cache" in resp.json()["error"]["message"]


def test_each_image_of_n_has_its_own_entry(image_server):
    base, backend = image_server
    body = {**BODY, "prompt": "n images", "n": 2, "seed": 21}
    first = post(base, body)
    single = {**body, "n": 1, "seed": 22}
    assert ran(backend, single, base) == 0  # image 2 of the n=2 request is seed 22's
    before = len(backend.jobs)
    shifted = post(base, {**body, "seed": 22})  # seeds 22 (stored) and 23 (new)
    assert [j.params.seed for j in backend.jobs[before:]] == [23]
    assert images(shifted)[0] == images(first)[1] and shifted.json()["seeds"] == [22, 23]


def sse_events(text: str) -> list[tuple[str, dict]]:
    out = []
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines())
        out.append((lines["event"], json.loads(lines["data"])))
    return out


def test_a_stream_stores_its_final_image_and_a_streamed_hit_sends_only_it(image_server):
    base, backend = image_server
    body = {**BODY, "prompt": "streamed", "stream": True, "partial_images": 2}
    events = sse_events(post(base, body).text)
    assert [e for e, _ in events] == ["image_generation.partial_image"] * 2 + ["image_generation.completed"]
    final = events[-1][1]["b64_json"]
    plain = {k: v for k, v in body.items() if k not in ("stream", "partial_images")}
    assert ran(backend, plain, base) == 0
    assert images(post(base, plain))[0] == base64.b64decode(final)
    before = len(backend.jobs)
    again = sse_events(post(base, body).text)
    assert len(backend.jobs) == before
    assert [e for e, _ in again] == ["image_generation.completed"] and again[0][1]["b64_json"] == final


def edit(base, image: bytes, prompt: str = "make it green") -> httpx.Response:
    data = {"prompt": prompt, "seed": "3", "size": "32x32"}
    resp = httpx.post(f"{base}/v1/images/edits", data=data, files={"image": ("a.png", image)}, headers=A)
    assert resp.status_code == 200, resp.text
    return resp


def test_an_edit_hits_only_with_the_same_input_pixels(image_server):
    base, backend = image_server
    before = len(backend.jobs)
    first = edit(base, png_bytes(value=10))
    assert images(edit(base, png_bytes(value=10))) == images(first)
    assert len(backend.jobs) == before + 1
    edit(base, png_bytes(value=11))
    assert len(backend.jobs) == before + 2


def test_a_bad_result_cache_form_value_is_a_400(image_server):
    base, _ = image_server
    data = {"prompt": "x", "seed": "3", "result_cache": "maybe"}
    resp = httpx.post(f"{base}/v1/images/edits", data=data, files={"image": ("a.png", png_bytes())}, headers=A)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "result_cache"


def test_the_cache_is_off_by_default(tmp_path):
    backend = FakeBackend(FakeFamily(tmp_path / "model"))
    with serve(create_app(backend, HeadConfig(data_dir=tmp_path / "data"))) as base:
        assert ran(backend, BODY, base, {}) == 1
        assert ran(backend, BODY, base, {}) == 1
        assert lookups(base) == {"hit": 0, "miss": 0, "bypassed": 2}


def test_a_repeated_video_is_completed_at_once_from_the_stored_mp4(tmp_path):
    backend = FakeBackend(FakeFamily(tmp_path / "video-model", is_video=True))
    config = HeadConfig(data_dir=tmp_path / "data", result_cache_mb=4)
    body = {"prompt": "a ball", "seed": 4, "size": "32x32", "frames": 5, "num_inference_steps": 2}
    with serve(create_app(backend, config)) as base:

        def create(payload):
            resp = httpx.post(f"{base}/v1/videos", json=payload, timeout=60)
            assert resp.status_code == 200, resp.text
            return resp.json()

        def content(video_id):
            wait_for(lambda: httpx.get(f"{base}/v1/videos/{video_id}").json()["status"] == "completed", "video done")
            return httpx.get(f"{base}/v1/videos/{video_id}/content").content

        first = create(body)
        mp4 = content(first["id"])
        again = create(body)
        assert again["status"] == "completed" and again["progress"] == 100 and again["id"] != first["id"]
        assert httpx.get(f"{base}/v1/videos/{again['id']}/content").content == mp4
        assert len(backend.jobs) == 1
        other = create({**body, "seed": 8})
        content(other["id"])
        assert len(backend.jobs) == 2


class CountingBackend(InProcessBackend):
    """The real in-process pipeline, counting the jobs it runs."""

    def __init__(self, family):
        super().__init__(family)
        self.runs = 0

    async def run(self, job, on_progress=None, on_preview=None):
        self.runs += 1
        return await super().run(job, on_progress, on_preview)


def test_a_real_model_repeat_returns_identical_bytes_without_running(tiny_model_dir, tmp_path):
    backend = CountingBackend(load_family(tiny_model_dir("flux")))
    config = HeadConfig(data_dir=tmp_path / "data", result_cache_mb=4)
    body = {"prompt": "a red cube", "seed": 7, "num_inference_steps": 2, "size": "64x64"}
    with serve(create_app(backend, config)) as base:
        first = images(post(base, body, {}))
        assert backend.runs == 1
        assert images(post(base, body, {})) == first
        assert backend.runs == 1
        post(base, {**body, "num_inference_steps": 3}, {})
        assert backend.runs == 2


def test_another_adapter_or_new_weights_under_the_same_name_miss(tmp_path):
    from safetensors.numpy import save_file

    from triptych.lora.config import LoraConfig

    files = {name: tmp_path / f"{name}.safetensors" for name in ("a", "b")}
    for i, file in enumerate(files.values()):  # a layout the head cannot check: served unchecked
        save_file({"x.weight": np.full((2, 2), i, dtype=np.float32)}, str(file))
    backend = FakeBackend(FakeFamily(tmp_path / "model"))
    lora = LoraConfig(lora=tuple(f"{name}={file}" for name, file in files.items()))
    config = HeadConfig(data_dir=tmp_path / "data", result_cache_mb=4, lora=lora)
    body = {**BODY, "lora": "a"}
    with serve(create_app(backend, config)) as base:
        assert ran(backend, body, base, {}) == 1
        assert ran(backend, body, base, {}) == 0
        assert ran(backend, {**body, "lora": "b"}, base, {}) == 1
        assert ran(backend, {**body, "lora": [{"name": "a", "scale": 0.5}]}, base, {}) == 1
        assert ran(backend, {k: v for k, v in body.items() if k != "lora"}, base, {}) == 1
        save_file({"x.weight": np.full((2, 2), 7, dtype=np.float32)}, str(files["a"]))  # retrained in place
        os.utime(files["a"], ns=(1, 1))  # a modification time of its own, whatever the clock's resolution
        assert ran(backend, body, base, {}) == 1
        assert ran(backend, body, base, {}) == 0


def test_another_teacache_threshold_or_recalibrated_profile_misses(tmp_path):
    from triptych.accel.teacache_profile import TeaCacheProfile, save_profile

    family = FakeFamily(tmp_path / "model")
    family.name = "flux"  # a family with a TeaCache plan; the head checks thresholds against its profiles
    profile = TeaCacheProfile("flux", "model", 2, (0.0, 0.0, 0.0, 1.0, 0.0), recommended_threshold=0.2)
    save_profile(profile, tmp_path / "model" / "teacache" / "flux-2steps.json")
    backend = FakeBackend(family)
    with serve(create_app(backend, HeadConfig(data_dir=tmp_path / "data", result_cache_mb=4))) as base:
        body = {**BODY, "teacache_threshold": 0.3}
        assert ran(backend, body, base, {}) == 1
        assert ran(backend, body, base, {}) == 0
        assert ran(backend, {**body, "teacache_threshold": 0.5}, base, {}) == 1
        assert ran(backend, {**body, "teacache_threshold": 0}, base, {}) == 1
        assert ran(backend, {**body, "teacache_threshold": "auto"}, base, {}) == 1
        recalibrated = TeaCacheProfile("flux", "model", 2, (0.0, 0.0, 0.0, 2.0, 0.0), recommended_threshold=0.2)
        save_profile(recalibrated, tmp_path / "model" / "teacache" / "flux-2steps.json")
        os.utime(tmp_path / "model" / "teacache" / "flux-2steps.json", ns=(1, 1))
        assert ran(backend, body, base, {}) == 1
