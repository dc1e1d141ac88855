"""Image routes over a real uvicorn server, driven by the official ``openai`` client.

A tiny FLUX model runs in an ``InProcessBackend``; outputs are compared pixel for pixel with
``run_request`` on a separately loaded copy of the same model.
"""

from __future__ import annotations

import base64

import httpx
import numpy as np
import openai
import pytest

from tests.e2e.http_support import decode_pixels, serve
from triptych.control.backend import InProcessBackend
from triptych.engine.runner import run_request
from triptych.families.base import GenerationParams
from triptych.families.registry import load_family
from triptych.head.app import HeadConfig, create_app


@pytest.fixture(scope="module")
def flux_dir(tiny_model_dir):
    return tiny_model_dir("flux")


@pytest.fixture(scope="module")
def server(flux_dir, tmp_path_factory):
    app = create_app(InProcessBackend(load_family(flux_dir)), HeadConfig(data_dir=tmp_path_factory.mktemp("head")))
    with serve(app) as base:
        yield base


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def reference(flux_dir):
    family = load_family(flux_dir)

    def ref(seed: int, **kw) -> np.ndarray:
        frames, _ = run_request(family, GenerationParams(prompt="a red cube", seed=seed, **kw))
        return frames.to_uint8()[0]

    return ref


def test_b64_json_is_bit_identical_to_run_request(client, reference):
    out = client.images.generate(
        prompt="a red cube", response_format="b64_json", extra_body={"seed": 7, "num_inference_steps": 3}
    )
    pixels = decode_pixels(base64.b64decode(out.data[0].b64_json))
    np.testing.assert_array_equal(pixels, reference(7, steps=3))


def test_url_link_serves_the_same_image(client, reference):
    out = client.images.generate(
        prompt="a red cube", response_format="url", extra_body={"seed": 7, "num_inference_steps": 3}
    )
    assert out.data[0].url.startswith("http://127.0.0.1:")
    resp = httpx.get(out.data[0].url)
    assert resp.status_code == 200 and resp.headers["content-type"] == "image/png"
    np.testing.assert_array_equal(decode_pixels(resp.content), reference(7, steps=3))


def test_url_unknown_file_is_404_in_openai_shape(server):
    resp = httpx.get(f"{server}/v1/files/file-doesnotexist0000000/content")
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "not_found"


def test_n2_gives_consecutive_seeds_and_different_images(client, reference):
    out = client.images.generate(
        prompt="a red cube", n=2, size="64x64", output_format="png", extra_body={"seed": 11, "num_inference_steps": 2}
    )
    a, b = (decode_pixels(base64.b64decode(d.b64_json)) for d in out.data)
    assert out.model_extra["seeds"] == [11, 12]
    assert not np.array_equal(a, b)
    np.testing.assert_array_equal(b, reference(12, steps=2))


def test_output_format_jpeg(client):
    out = client.images.generate(prompt="x", output_format="jpeg", extra_body={"seed": 1, "num_inference_steps": 1})
    assert base64.b64decode(out.data[0].b64_json)[:3] == b"\xff\xd8\xff"
    assert out.output_format == "jpeg"


def test_output_compression_sets_the_jpeg_and_webp_quality(client, reference):
    """OpenAI's ``output_compression`` is the lossy encoders' quality: lower means fewer bytes and
    a farther copy of the very pixels ``run_request`` makes; png (lossless) refuses it."""
    want = reference(3, steps=2).astype(float)
    for fmt in ("jpeg", "webp"):
        sizes, errors = [], []
        for q in (100, 5):
            out = client.images.generate(
                prompt="a red cube",
                output_format=fmt,
                output_compression=q,
                extra_body={"seed": 3, "num_inference_steps": 2},
            )
            data = base64.b64decode(out.data[0].b64_json)
            sizes.append(len(data))
            errors.append(np.abs(decode_pixels(data).astype(float) - want).mean())
        assert sizes[1] < sizes[0] and errors[1] > errors[0], (fmt, sizes, errors)
    with pytest.raises(openai.BadRequestError) as e:
        client.images.generate(prompt="x", output_format="png", output_compression=50)
    assert e.value.body["param"] == "output_compression" and "png" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.images.generate(prompt="x", output_format="jpeg", output_compression=101)
    assert e.value.body["param"] == "output_compression"


def test_edits_on_text_only_family_is_400_naming_image(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.images.edit(image=("a.png", b"\x89PNG..."), prompt="make it blue")
    err = e.value.body
    assert err["param"] == "image" and "text-only" in err["message"] and err["type"] == "invalid_request_error"


@pytest.mark.parametrize("size", ["64x", "0x64", "65x64", "99999999x99999999", "big", "-64x64"])
def test_bad_size_is_400_naming_size(client, size):
    with pytest.raises(openai.BadRequestError) as e:
        client.images.generate(prompt="x", size=size)
    assert e.value.body["param"] == "size"
    assert repr(size) in e.value.body["message"]


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "x", "n": "2"}, "n"),
        ({"prompt": 3}, "prompt"),
        ({}, "prompt"),
        ({"prompt": "x", "guidance_scale": "high"}, "guidance_scale"),
        ({"prompt": "x", "seed": -1}, "seed"),
        ({"prompt": "x", "n": 99}, "n"),
        ({"prompt": "x", "num_inference_steps": 10_000}, "num_inference_steps"),
        ({"prompt": "x", "output_format": "gif"}, "output_format"),
        ({"prompt": "x", "num_steps": 3}, "num_steps"),
        ({"prompt": "x", "negative_prompt": "blurry"}, "negative_prompt"),
        ({"prompt": "x", "model": "dall-e-3"}, None),
        (["not", "an", "object"], None),
    ],
)
def test_wrong_fields_are_4xx_in_openai_shape(server, body, param):
    resp = httpx.post(f"{server}/v1/images/generations", json=body)
    assert resp.status_code in (400, 404), resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["param"] == param
    if param:
        assert param in err["message"]


def test_invalid_json_and_nan_are_400(server):
    for raw in (b"{bad json", b'{"prompt": "x", "guidance_scale": NaN}'):
        resp = httpx.post(f"{server}/v1/images/generations", content=raw, headers={"content-type": "application/json"})
        assert resp.status_code == 400 and "error" in resp.json()


def test_video_route_on_image_model_is_400(server):
    resp = httpx.post(f"{server}/v1/videos", json={"prompt": "x"})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "model"


def _sample(text: str, series: str) -> float:
    """The value of one series (name with labels) in a Prometheus text exposition, 0 when absent."""
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(series + " ")]
    return values[0] if values else 0.0


def test_models_health_and_metrics(client, server):
    """Counts its own generation (the server is shared by the module: no test relies on another's)."""
    models = client.models.list()
    assert [m.id for m in models.data] == [client.models.retrieve(models.data[0].id).id]
    assert httpx.get(f"{server}/health").json()["status"] == "ok"
    model = models.data[0].id
    success = f'triptych_requests_total{{endpoint="/v1/images/generations",model="{model}",outcome="success"}}'
    before = _sample(httpx.get(f"{server}/metrics").text, success)
    client.images.generate(prompt="x", extra_body={"seed": 1, "num_inference_steps": 1})
    text = httpx.get(f"{server}/metrics").text
    for name in (
        "triptych_queue_depth",
        "triptych_queue_wait_seconds",
        "triptych_stage_run_seconds",
        "triptych_transfer_bytes_total",
        "triptych_transfer_latency_seconds",
        "triptych_requests_total",
        "triptych_instances",
    ):
        assert f"# TYPE {name} " in text, name
    assert _sample(text, success) == before + 1


def test_streamed_in_process_previews_leave_the_image_unchanged(client, reference):
    events = list(
        client.images.generate(
            prompt="a red cube", stream=True, partial_images=2, extra_body={"seed": 7, "num_inference_steps": 4}
        )
    )
    assert [getattr(e, "partial_image_index", None) for e in events] == [0, 1, None]
    np.testing.assert_array_equal(decode_pixels(base64.b64decode(events[-1].b64_json)), reference(7, steps=4))
    assert not np.array_equal(decode_pixels(base64.b64decode(events[0].b64_json)), reference(7, steps=4))
