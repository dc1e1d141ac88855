"""Slow end-to-end checks of the head over real model backends (``--run-slow``).

- edits through the ``openai`` client on tiny Qwen-Image-Edit, bit-identical to ``run_request``;
- generations over the disaggregated ``EmbeddedBackend`` (worker processes), bit-identical too.
"""

from __future__ import annotations

import base64

import numpy as np
import openai
import pytest

from tests.e2e.http_support import decode_pixels, png_bytes, serve
from triptych.core.media import decode_image
from triptych.engine.runner import run_request
from triptych.families.base import GenerationParams
from triptych.families.registry import load_family
from triptych.head.app import HeadConfig, create_app

pytestmark = pytest.mark.slow


def reference(model_dir, **params) -> np.ndarray:
    frames, _ = run_request(load_family(model_dir), GenerationParams(**params))
    return frames.to_uint8()[0]


def test_edit_on_qwen_image_edit_matches_run_request(tiny_model_dir, tmp_path):
    from triptych.control.backend import InProcessBackend

    model = tiny_model_dir("qwen-image-edit")
    upload = png_bytes(32, 32, value=90)
    app = create_app(InProcessBackend(load_family(model)), HeadConfig(data_dir=tmp_path / "data"))
    with serve(app) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        out = client.images.edit(
            image=("in.png", upload),
            prompt="make it blue",
            size="64x64",
            extra_body={"seed": 2, "num_inference_steps": 2},
        )
    got = decode_pixels(base64.b64decode(out.data[0].b64_json))
    want = reference(model, prompt="make it blue", image=decode_image(upload), height=64, width=64, seed=2, steps=2)
    np.testing.assert_array_equal(got, want)


def test_generations_over_embedded_backend_match_run_request(tiny_model_dir, tmp_path):
    from triptych.control.orchestrator import OrchestratorConfig
    from triptych.deploy.launch import EmbeddedBackend

    model = tiny_model_dir("flux")
    backend = EmbeddedBackend(model, OrchestratorConfig(host="127.0.0.1", control_port=0))
    with serve(create_app(backend, HeadConfig(data_dir=tmp_path / "data"))) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        out = client.images.generate(prompt="a red cube", n=2, extra_body={"seed": 3, "num_inference_steps": 2})
    for i, item in enumerate(out.data):
        want = reference(model, prompt="a red cube", seed=3 + i, steps=2)
        np.testing.assert_array_equal(decode_pixels(base64.b64decode(item.b64_json)), want)
