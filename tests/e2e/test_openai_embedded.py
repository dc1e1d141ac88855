"""The official ``openai`` client against the embedded disaggregated server (head + encoder,
denoiser and decoder worker processes): an image (over ZMQ) and a video (once per transfer
backend), each bit-identical to ``triptych generate`` (``run_request`` + the same media encoder) for
the same model, seed and parameters. Tensors move worker to worker over the named backend; an image
over Mooncake is checked bit-identical in ``tests/distributed/test_orchestrator.py``, so it is not
served a second time here."""

from __future__ import annotations

import base64

import numpy as np
import openai
import pytest

from tests.e2e.http_support import decode_pixels, serve, wait_for
from tests.helpers import NEEDS_MOONCAKE
from triptych.core.media import encode_frames
from triptych.engine.runner import run_request
from triptych.families.base import GenerationParams
from triptych.families.registry import load_family
from triptych.head.app import HeadConfig, create_app

BACKENDS = [
    "zmq",
    pytest.param("mooncake", marks=NEEDS_MOONCAKE),
]


def embedded(model_dir, transfer: str, tmp_path):
    from triptych.control.orchestrator import OrchestratorConfig
    from triptych.deploy.launch import EmbeddedBackend, TopologyConfig

    backend = EmbeddedBackend(
        model_dir,
        OrchestratorConfig(host="127.0.0.1", control_port=0),
        TopologyConfig(transfer=transfer, torch_threads=1),
    )
    return serve(create_app(backend, HeadConfig(data_dir=tmp_path / "data", video_fps=8)))


def test_image_matches_generate(tiny_model_dir, tmp_path):
    model = tiny_model_dir("flux")
    with embedded(model, "zmq", tmp_path) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        out = client.images.generate(
            prompt="a red cube", size="64x48", extra_body={"seed": 5, "num_inference_steps": 3}
        )
    frames, _ = run_request(
        load_family(model), GenerationParams(prompt="a red cube", seed=5, steps=3, height=48, width=64)
    )
    np.testing.assert_array_equal(decode_pixels(base64.b64decode(out.data[0].b64_json)), frames.to_uint8()[0])


@pytest.mark.parametrize("transfer", BACKENDS)
def test_video_matches_generate(tiny_model_dir, tmp_path, transfer):
    model = tiny_model_dir("wan-t2v")
    with embedded(model, transfer, tmp_path) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        video = client.videos.create(
            prompt="a boat", size="32x32", extra_body={"frames": 5, "num_inference_steps": 2, "seed": 7}
        )
        seen: list[int] = []

        def poll():
            v = client.videos.retrieve(video.id)
            seen.append(v.progress)
            return v.status in ("completed", "failed") and v

        done = wait_for(poll, "video done", deadline_s=300, every_s=0.005)
        assert done.status == "completed", done
        assert seen == sorted(seen) and seen[-1] == 100, seen  # steps x 90 / total, then the decode
        mp4 = client.videos.download_content(video.id).read()
    frames, _ = run_request(
        load_family(model), GenerationParams(prompt="a boat", seed=7, steps=2, frames=5, height=32, width=32)
    )
    assert mp4 == encode_frames(frames.to_uint8(), "mp4", fps=8)
