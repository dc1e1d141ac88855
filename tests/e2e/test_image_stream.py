"""Streamed image generation (``stream=true``, ``partial_images``) through the official ``openai``
client against the embedded disaggregated server: previews decoded by the decoder pool from the
denoiser's predicted clean latents, then the final image, bit-identical to the non-streamed one."""

from __future__ import annotations

import base64
import io

import numpy as np
import openai
import pytest
from PIL import Image

from tests.e2e.http_support import decode_pixels, serve
from triptych.head.app import HeadConfig, create_app

STEPS = 4
PROMPT = "a red cube"


@pytest.fixture(scope="module")
def client(tiny_model_dir, tmp_path_factory):
    from triptych.control.orchestrator import OrchestratorConfig
    from triptych.deploy.launch import EmbeddedBackend, TopologyConfig

    backend = EmbeddedBackend(
        tiny_model_dir("flux"),
        OrchestratorConfig(host="127.0.0.1", control_port=0),
        TopologyConfig(transfer="zmq", torch_threads=1),
    )
    app = create_app(backend, HeadConfig(data_dir=tmp_path_factory.mktemp("stream") / "data"))
    with serve(app) as base:
        yield openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)


def generate(client, seed: int, **kw):
    return client.images.generate(
        prompt=PROMPT, size="64x48", extra_body={"seed": seed, "num_inference_steps": STEPS}, **kw
    )


def test_two_partials_then_the_unstreamed_image(client):
    plain = generate(client, seed=11).data[0].b64_json
    events = list(generate(client, seed=11, stream=True, partial_images=2))
    assert [e.type for e in events] == ["image_generation.partial_image"] * 2 + ["image_generation.completed"]
    assert [e.partial_image_index for e in events[:2]] == [0, 1]
    final = events[-1]
    assert final.b64_json == plain  # the same PNG bytes: previews change nothing
    assert final.size == "64x48" and final.output_format == "png" and final.usage.total_tokens == 0
    previews = [base64.b64decode(e.b64_json) for e in events[:2]]
    for data in previews:
        with Image.open(io.BytesIO(data)) as im:
            assert im.format == "PNG" and im.size == (64, 48)
    last = decode_pixels(base64.b64decode(plain)).astype(int)
    first, second = (decode_pixels(d).astype(int) for d in previews)
    assert not np.array_equal(first, second)  # two different steps' predictions
    # a later prediction is closer to the final image than an earlier one
    assert np.abs(second - last).mean() < np.abs(first - last).mean()


def test_zero_partials_is_one_completed_event(client):
    events = list(generate(client, seed=12, stream=True, partial_images=0))
    assert [e.type for e in events] == ["image_generation.completed"]
    assert events[0].b64_json == generate(client, seed=12).data[0].b64_json


@pytest.mark.parametrize("partials", [1, 3])
def test_each_count_of_partials(client, partials):
    events = list(generate(client, seed=13, stream=True, partial_images=partials))
    assert [getattr(e, "partial_image_index", None) for e in events] == [*range(partials), None]


def test_partial_images_out_of_range_is_a_400_naming_it(client):
    with pytest.raises(openai.BadRequestError) as err:
        generate(client, seed=1, stream=True, partial_images=4)
    assert err.value.body["param"] == "partial_images" and "partial_images=4" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        generate(client, seed=1, partial_images=2)
    assert err.value.body["param"] == "partial_images" and "stream=true" in err.value.body["message"]
