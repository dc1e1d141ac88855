"""One head serving every built-in model, as a bare ``triptych serve`` does
(``cli.serve.build_backends(builtin_models())``): the packaged default, which generates and edits
over one set of weights with one set of pools, and the packaged video model, each model with its own
local encoder/denoiser/decoder pools, driven by the official ``openai`` client.

The edit is bit-identical to the edit-only directory's ``triptych generate`` path (``run_request``
over ``assets/default_edit``, a plain ``QwenImageEditPipeline`` of the same weights) and the video
to the video model's; both are read back by the shape world's scorers. The chat answer is the one
the model's VLM gives in process. Also: a size off a model's trained sizes comes with a note, in the
REST response and from ``triptych generate``.
"""

from __future__ import annotations

import base64
import io
import re

import httpx
import numpy as np
import openai
import pytest

from tests.e2e.http_support import decode_pixels, serve, wait_for
from triptych.core.media import encode_frames
from triptych.engine.runner import run_request
from triptych.families.base import GenerationParams
from triptych.families.models import PACKAGED_DEFAULT, PACKAGED_EDIT, PACKAGED_VIDEO, builtin_models
from triptych.families.registry import load_family
from triptych.head.app import HeadConfig, create_app

pytestmark = pytest.mark.skipif(
    not all((d / "model_index.json").is_file() for d in (PACKAGED_DEFAULT, PACKAGED_VIDEO)),
    reason="no trained default or video model shipped",
)
FPS = 8
#: What the served video is held to, read back by the video scorer: shape kind, colour and background
#: on at least MIN_FRAME_SHARE of the frames, and the direction of motion (this prompt and seed:
#: measured shape kind on 8 of 9 frames, the rest on all; assets/video/MODEL_CARD.md has the 50-prompt
#: figures: the shape kind on 84% of videos, the others on all).
VIDEO_FRAME_CHECKS = ("shape", "color", "background")
VIDEO_CLIP_CHECKS = ("direction",)


def png(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def heldout_edit():
    from shapeworld import sample_edit_pairs

    return sample_edit_pairs(1, "serve-many", "heldout")[0]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from triptych.cli.serve import build_backends
    from triptych.control.orchestrator import OrchestratorConfig
    from triptych.deploy.launch import TopologyConfig

    models = builtin_models()
    assert models == {"default": PACKAGED_DEFAULT, "video": PACKAGED_VIDEO}
    backends = build_backends(
        models, OrchestratorConfig(host="127.0.0.1"), TopologyConfig(transfer="zmq", torch_threads=1)
    )
    data = tmp_path_factory.mktemp("serve-many")
    with serve(create_app(backends, HeadConfig(data_dir=data, video_fps=FPS)), start_timeout_s=300) as base:
        yield models, base, openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)


def test_models_lists_each_model_with_its_kind_and_health_shows_every_pool(server):
    _, base, client = server
    cards = {m.id: (m.kind, m.chat) for m in client.models.list().data}
    assert cards == {"default": ("image+edit", True), "video": ("video", False)}
    health = httpx.get(f"{base}/health").json()
    assert health["status"] == "ok" and sorted(health["models"]) == ["default", "video"]
    for name in cards:  # one pool per role per model: generation and edits share the default's
        roles = sorted(i["role"] for i in health["models"][name]["backend"]["instances"])
        assert roles == ["decoder", "denoiser", "encoder"], (name, roles)


def test_unknown_model_is_a_404_naming_the_served_ids(server):
    _, _, client = server
    with pytest.raises(openai.NotFoundError) as e:
        client.images.generate(prompt="x", model="nope")
    assert "'nope'" in e.value.body["message"] and "'default', 'video'" in e.value.body["message"]


def test_generate_edit_video_and_chat_on_one_server(server):
    from shapeworld import render, score
    from shapeworld.video import clip_caption, sample_clips
    from shapeworld.video_scorer import MIN_FRAME_SHARE, score_clip

    models, base, client = server
    extra = {"seed": 3, "num_inference_steps": 4}
    out = client.images.generate(prompt="a red circle on a white background", extra_body=extra)
    assert decode_pixels(base64.b64decode(out.data[0].b64_json)).shape == (64, 64, 3)
    assert getattr(out, "warnings", None) is None  # 64x64: the size it was trained at

    pair = heldout_edit()  # the first held-out edit pair of a fixed seed, at the model's defaults
    image = render(pair.source, 64)
    edited = client.images.edit(
        image=("a.png", png(image), "image/png"), prompt=pair.instruction, extra_body={"seed": 3}
    )  # no model: the first edit-capable one, the default
    got = decode_pixels(base64.b64decode(edited.data[0].b64_json))
    want, _ = run_request(load_family(PACKAGED_EDIT), GenerationParams(prompt=pair.instruction, image=image, seed=3))
    np.testing.assert_array_equal(got, want.to_uint8()[0])
    assert score(got, pair.target)[pair.attribute], (pair.instruction, score(got, pair.target))

    clip = sample_clips(1, "serve-many", "heldout")[0]
    prompt = clip_caption(clip, "short")
    video = client.videos.create(prompt=prompt, extra_body={"frames": 9, "seed": 0})
    assert video.model == "video"
    done = wait_for(
        lambda: (v := client.videos.retrieve(video.id)).status in ("completed", "failed") and v,
        "video done",
        deadline_s=300,
    )
    assert done.status == "completed", done
    mp4 = client.videos.download_content(video.id).read()
    frames, _ = run_request(load_family(models["video"]), GenerationParams(prompt=prompt, seed=0, frames=9))
    assert mp4 == encode_frames(frames.to_uint8(), "mp4", fps=FPS)
    scored = score_clip(frames.to_uint8(), clip)  # the very frames the MP4 holds
    assert all(scored[k] >= MIN_FRAME_SHARE for k in VIDEO_FRAME_CHECKS) and all(
        scored[k] for k in VIDEO_CLIP_CHECKS
    ), (prompt, scored)

    url = "data:image/png;base64," + base64.b64encode(png(image)).decode()
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What is in this image?"}]
    body = {"messages": [{"role": "user", "content": content}], "max_completion_tokens": 24}
    answer = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120).json()  # no model: the SDK needs one
    assert answer["model"] == "default" and answer["choices"][0]["message"]["content"], answer

    metrics = httpx.get(f"{base}/metrics").text
    for endpoint, model in (
        ("/v1/images/generations", "default"),
        ("/v1/images/edits", "default"),
        ("/v1/videos", "video"),
        ("/v1/chat/completions", "default"),
    ):
        assert f'triptych_requests_total{{endpoint="{endpoint}",model="{model}",outcome="success"}}' in metrics
    runs = r'triptych_stage_run_seconds_count\{model="video",stage="denoise"\} (\S+)'
    assert float(re.search(runs, metrics).group(1)) >= 1  # the video ran on the video model's own pools


def test_a_size_the_model_was_not_trained_at_comes_with_a_warning(server):
    _, _, client = server
    raw = client.images.with_raw_response.generate(
        prompt="a red circle", size="32x32", extra_body={"seed": 1, "num_inference_steps": 2}
    )
    out = raw.parse()
    assert out.warnings and "trained at 64x64 only" in out.warnings[0] and "32x32" in out.warnings[0]
    assert raw.headers["x-triptych-warning"] == out.warnings[0]


def test_generate_prints_a_warning_off_the_trained_sizes(tmp_path, capsys):
    from triptych.cli import main

    argv = ["generate", "--prompt", "a red circle", "--steps", "2", "--out", str(tmp_path / "a.png")]
    assert main([*argv, "--height", "32", "--width", "32"]) == 0
    assert "warning: model 'default' was trained at 64x64 only; at 32x32" in capsys.readouterr().err
    assert main(argv) == 0
    assert "warning" not in capsys.readouterr().err
