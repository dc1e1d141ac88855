"""``POST /v1/chat/completions`` through the official ``openai`` client, on the packaged default edit
model: in process (the route's checks, streaming shape, errors), and on the embedded disaggregated
server (an encoder worker answers; an edit and a chat about the same image share its mm-hash cache;
an edit is not held up by a long answer on the same encoder; a client that disconnects stops the
worker's generation)."""

from __future__ import annotations

import base64
import io
import json

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from shapeworld import render, sample_scenes, score_caption
from tests.e2e.http_support import serve, wait_for
from triptych.control.backend import InProcessBackend
from triptych.families.models import PACKAGED_DEFAULT
from triptych.families.registry import load_family
from triptych.head.admission import AdmissionLimits
from triptych.head.app import HeadConfig, create_app

EDIT_MODEL = PACKAGED_DEFAULT.parent / "default_edit"
QUESTION = "What is in this image?"


def data_url(image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def user(image, text: str = QUESTION) -> list[dict]:
    return [
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": data_url(image)}}, {"type": "text", "text": text}],
        }
    ]


@pytest.fixture(scope="module")
def family():
    return load_family(EDIT_MODEL)


@pytest.fixture(scope="module")
def scene():
    return sample_scenes(1, "http-chat", "heldout")[0]


def test_in_process_answer_stream_and_usage(family, scene, tmp_path):
    backend = InProcessBackend(family)
    image = render(scene, 64)
    with serve(create_app(backend, HeadConfig(data_dir=tmp_path))) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        out = client.chat.completions.create(model="default_edit", messages=user(image), seed=3)
        answer = out.choices[0].message.content
        assert score_caption(answer, scene)["color"], answer
        assert out.choices[0].finish_reason == "stop" and out.object == "chat.completion"
        assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
        assert out.usage.prompt_tokens > 16  # the image's 16 vision tokens are part of the prompt
        chunks = list(
            client.chat.completions.create(
                messages=user(image), model="default_edit", stream=True, stream_options={"include_usage": True}
            )
        )
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == answer  # greedy: the streamed answer is the same answer
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
        assert chunks[-1].usage.completion_tokens == out.usage.completion_tokens and not chunks[-1].choices
        short = client.chat.completions.create(model="default_edit", messages=user(image), max_completion_tokens=2)
        assert short.choices[0].finish_reason == "length" and short.usage.completion_tokens == 2
        health = httpx.get(f"{base}/health").json()
        assert health["in_flight"] == 0
        metrics = httpx.get(f"{base}/metrics").text
        assert 'triptych_chat_tokens_total{kind="completion",model="default_edit"}' in metrics


@pytest.mark.parametrize(
    "change, param",
    [
        ({"n": 2}, "n"),
        ({"stop": ["x"]}, "stop"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"max_tokens": 5000}, "max_tokens"),
        ({"max_tokens": 3, "max_completion_tokens": 4}, "max_tokens"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"temperature": 2.5}, "temperature"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}, "messages[1].role"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "messages.0.role"),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://10.0.0.1/a.png"}}]}
                ]
            },
            "messages[0].content[0].image_url.url",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAA"}}],
                    }
                ]
            },
            "messages[0].content[0].image_url.url",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "image_url",
                                "image_url": {
                                    "url": "data:image/png;base64," + base64.b64encode(b"not a png").decode()
                                },
                            }
                        ],
                    }
                ]
            },
            "messages[0].content[0].image_url.url",
        ),
        (
            {
                "messages": [
                    {"role": "assistant", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]},
                    {"role": "user", "content": "hi"},
                ]
            },
            "messages[0].content[0]",
        ),
        ({"frobnicate": 1}, "frobnicate"),
    ],
)
def test_bad_requests_are_400s_naming_the_field(family, tmp_path, change, param):
    backend = InProcessBackend(family)
    with serve(create_app(backend, HeadConfig(data_dir=tmp_path))) as base:
        body = {"messages": [{"role": "user", "content": "hi"}], **change}
        resp = httpx.post(f"{base}/v1/chat/completions", json=body)
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert error["param"] == param and error["type"] == "invalid_request_error", error
        assert httpx.get(f"{base}/health").json()["in_flight"] == 0


def test_unknown_model_is_a_404(family, tmp_path):
    with serve(create_app(InProcessBackend(family), HeadConfig(data_dir=tmp_path))) as base:
        resp = httpx.post(
            f"{base}/v1/chat/completions", json={"model": "other", "messages": [{"role": "user", "content": "hi"}]}
        )
        assert resp.status_code == 404 and "default_edit" in resp.json()["error"]["message"]


def test_limits_and_models_without_a_vlm(family, scene, tmp_path, tiny_model_dir):
    image = render(scene, 64)
    limits = AdmissionLimits(max_chat_images=1, max_chat_tokens=8000)
    with serve(create_app(InProcessBackend(family), HeadConfig(data_dir=tmp_path / "a", limits=limits))) as base:
        two = [{"role": "user", "content": user(image)[0]["content"] + user(image)[0]["content"]}]
        resp = httpx.post(f"{base}/v1/chat/completions", json={"messages": two})
        assert resp.status_code == 400 and "max_chat_images" in resp.json()["error"]["message"]
        for stream in (False, True):  # only the model knows its context: still a 400, streamed or not
            resp = httpx.post(
                f"{base}/v1/chat/completions", json={"messages": user(image), "max_tokens": 4096, "stream": stream}
            )
            assert resp.status_code == 400 and resp.json()["error"]["param"] == "max_tokens", resp.text
            assert "context of 4096 tokens" in resp.json()["error"]["message"]
    flux = load_family(tiny_model_dir("flux"))
    with serve(create_app(InProcessBackend(flux), HeadConfig(data_dir=tmp_path / "b"))) as base:
        resp = httpx.post(f"{base}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "model"


def embedded(model_dir, tmp_path):
    from triptych.control.orchestrator import OrchestratorConfig
    from triptych.deploy.launch import EmbeddedBackend, TopologyConfig

    backend = EmbeddedBackend(
        model_dir,
        OrchestratorConfig(host="127.0.0.1", control_port=0, heartbeat_interval_s=0.2, heartbeat_timeout_s=5.0),
        TopologyConfig(transfer="zmq", torch_threads=1),
    )
    limits = AdmissionLimits(max_chat_tokens=4000)
    return backend, serve(create_app(backend, HeadConfig(data_dir=tmp_path / "data", limits=limits)))


def _mm_hits(base: str, result: str = "hits") -> float:
    for line in httpx.get(f"{base}/metrics").text.splitlines():
        if line.startswith(f'triptych_mm_cache_lookups_total{{model="default_edit",result="{result}"}}'):
            return float(line.split()[-1])
    return 0.0


CHAT_LATENCY = ("media_decode", "queue", "vision_encode", "prefill", "time_to_first_token", "inter_token")


def _chat_latency(base: str) -> dict[str, float]:
    """The chat latency histograms' ``_sum`` and ``_count`` for the model (``triptych_chat_*_seconds``)."""
    out = {}
    for family in text_string_to_metric_families(httpx.get(f"{base}/metrics").text):
        for s in family.samples:
            if s.labels.get("model") == "default_edit" and s.name.endswith(("_sum", "_count")):
                out[s.name] = s.value
    return out


def _check_chat_latency(before: dict[str, float], after: dict[str, float], chunks: list) -> None:
    """One streamed chat with an image, recorded at the head once its answer ended: every stage
    histogram counts it once, its stages lie inside its time to first token, and one gap lies
    between each two of its streamed pieces."""

    def delta(name: str, what: str) -> float:
        key = f"triptych_chat_{name}_seconds_{what}"
        return after.get(key, 0.0) - before.get(key, 0.0)

    for name in CHAT_LATENCY[:-1]:
        assert delta(name, "count") == 1, name
    assert delta("time_to_first_token", "sum") >= delta("vision_encode", "sum") + delta("prefill", "sum") > 0
    pieces = [c for c in chunks if c.choices and c.choices[0].delta.content and c.choices[0].delta.role is None]
    assert len(pieces) > 1
    assert delta("inter_token", "count") == len(pieces) - 1


def _metric(base: str, name: str) -> float:
    for line in httpx.get(f"{base}/metrics").text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def test_embedded_chat_on_the_encoder_shares_the_edit_cache_and_stops_when_the_client_leaves(family, scene, tmp_path):
    image = render(scene, 64)
    from triptych.chat import ChatParams, ChatTurn

    reference = family.chat_model().run(ChatParams((ChatTurn("user", (0, QUESTION)),), (image,), 256)).text
    backend, server = embedded(EDIT_MODEL, tmp_path)
    with server as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        encoders = [i for i in httpx.get(f"{base}/health").json()["backend"]["instances"] if i["role"] == "encoder"]
        assert len(encoders) == 1
        # an edit of the image first: its encode puts the vision tower's output in the encoder's cache
        before = _mm_hits(base, "misses")  # the metrics registry is the process's: others may have counted
        hits = _mm_hits(base)
        buf = io.BytesIO()
        image.save(buf, format="PNG")
        client.images.edit(
            image=("a.png", buf.getvalue(), "image/png"), prompt="make the shape red", extra_body={"seed": 1}
        )
        # the edit's image is looked up once (a miss; both CFG branches read the entry the encoder
        # layer fetched for the edit, not counted again)
        wait_for(lambda: _mm_hits(base, "misses") > before, "stats report after the edit")
        out = client.chat.completions.create(messages=user(image), model="default_edit")
        assert out.choices[0].message.content == reference  # the worker answers what the model answers in process
        wait_for(lambda: _mm_hits(base) > hits, "the chat's hit on the edit's entry")
        before = _chat_latency(base)
        chunks = [c for c in client.chat.completions.create(model="default_edit", messages=user(image), stream=True)]
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert streamed == reference
        _check_chat_latency(before, _chat_latency(base), chunks)
        # A long answer (4000 tokens, no early stop) on the only encoder. While it is generating, an
        # edit goes through that encoder (encodes run between tokens) and finishes before it; then
        # the client, having read one piece, leaves.
        body = {
            "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 4000,
            "ignore_eos": True,
            "stream": True,
        }
        with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=60) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()  # kept: a dropped line iterator closes the response
            while not (
                (line := next(lines)).startswith("data: ")
                and json.loads(line[6:])["choices"][0]["delta"].get("content")
            ):
                pass
            client.images.edit(image=("a.png", buf.getvalue(), "image/png"), prompt="make the background blue")
            stats = httpx.get(f"{base}/health").json()["backend"]["stats"]
            assert stats["chat_done"] == 2 and stats.get("chat_cancelled", 0) == 0, stats  # still generating
        wait_for(lambda: httpx.get(f"{base}/health").json()["backend"]["stats"].get("chat_cancelled"), "chat cancel")
        # the encoder serves one task at a time: this answer comes after the cancelled chat stopped
        again = client.chat.completions.create(model="default_edit", messages=user(image))
        assert again.choices[0].message.content == reference
        health = httpx.get(f"{base}/health").json()
        stats = health["backend"]["stats"]
        assert stats.get("chat_done_after_end", 0) == 0, stats  # it never finished the 4000 tokens
        assert stats["chat_done"] == 3 and health["in_flight"] == 0
        assert all(not i["held"] for i in health["backend"]["instances"])
        # a clip on the encoder: asked again, its frames all hit the encoder's mm-hash cache
        scenes = sample_scenes(4, "http-chat-embedded", "heldout")
        movie = mp4_url(clip([render(s, 64) for s in scenes for _ in (0, 1)], fps=4))  # sampled: one of each
        misses = _mm_hits(base, "misses")
        client.chat.completions.create(model="default_edit", messages=video_user(movie), max_tokens=8)
        wait_for(lambda: _mm_hits(base, "misses") >= misses + 4, "the clip's 4 frames looked up")  # 2 s at 2 fps
        forwards, hits = _metric(base, "triptych_vision_tower_forwards_total"), _mm_hits(base)
        client.chat.completions.create(model="default_edit", messages=video_user(movie), max_tokens=8)
        wait_for(lambda: _mm_hits(base) >= hits + 4, "the clip's frames hit again")
        assert _metric(base, "triptych_vision_tower_forwards_total") == forwards


# ---- chat about videos ---------------------------------------------------------------------------
VIDEO_LIMITS = AdmissionLimits(max_chat_video_pixels=64 * 64, max_chat_video_frames=16)


def clip(images, fps: int = 8) -> bytes:
    import numpy as np

    from triptych.core.media import encode_video

    return encode_video(np.stack([np.asarray(im.convert("RGB")) for im in images]), fps=fps)


def video_user(data: str, text: str = "What happens in this video?", **extra) -> list[dict]:
    part = {"type": "video_url", "video_url": {"url": data}, **extra}
    return [{"role": "user", "content": [part, {"type": "text", "text": text}]}]


def mp4_url(data: bytes) -> str:
    return "data:video/mp4;base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def video_server(family, tmp_path_factory):
    """One in-process server for the video tests: (base URL, the app's head)."""
    app = create_app(
        InProcessBackend(family), HeadConfig(data_dir=tmp_path_factory.mktemp("video"), limits=VIDEO_LIMITS)
    )
    with serve(app) as base:
        yield base, app.state.head


@pytest.fixture(scope="module")
def scene_clip():
    scenes = sample_scenes(2, "http-chat-video", "heldout")
    return clip([render(scenes[i % 2], 64) for i in range(24)])  # 3 s at 8 fps


def _forwards(family) -> int:
    return family.mm_cache.snapshot().forwards


def test_video_chat_is_answered_and_asked_again_runs_no_vision_work(family, video_server, scene_clip):
    from triptych.core.video_input import VideoLimits, decode_video

    base, _ = video_server
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
    body = video_user(mp4_url(scene_clip))
    out = client.chat.completions.create(model="default_edit", messages=body, max_tokens=16)
    assert out.choices[0].message.content.strip()
    # 3 s at the default 2 fps: 6 frames of 16 vision tokens each are in the prompt
    assert out.usage.prompt_tokens > 6 * 16, out.usage
    assert family.mm_cache is not None
    before = _forwards(family)
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(model="default_edit", messages=body, max_tokens=16, stream=True)
        if c.choices
    )
    assert streamed == out.choices[0].message.content  # greedy: the same answer
    assert _forwards(family) == before  # every frame's vision output came from the cache
    # a frame of the clip sent as an image is the same image item: no vision forward either
    frame = decode_video(scene_clip, VideoLimits(), "clip", fps=2.0)[3].image
    client.chat.completions.create(model="default_edit", messages=user(frame), max_tokens=4)
    assert _forwards(family) == before
    # fewer frames asked for: fewer prompt tokens
    two = client.chat.completions.create(
        model="default_edit", messages=video_user(mp4_url(scene_clip), max_frames=2), max_tokens=4
    )
    assert two.usage.prompt_tokens < out.usage.prompt_tokens - 3 * 16, (two.usage, out.usage)


def test_a_long_clip_is_sampled_not_refused(video_server):
    import numpy as np
    from PIL import Image

    base, _ = video_server
    frames = np.zeros((400, 32, 48, 3), np.uint8)
    frames[:, :, :, 0] = (np.arange(400) % 256)[:, None, None]
    data = mp4_url(clip([Image.fromarray(f) for f in frames], fps=16))
    for stream in (False, True):
        resp = httpx.post(
            f"{base}/v1/chat/completions",
            json={"messages": video_user(data), "max_tokens": 4, "stream": stream},
            timeout=60,
        )
        assert resp.status_code == 200, resp.text

    def prompt_tokens(**extra) -> int:
        body = {"messages": video_user(data, **extra), "max_tokens": 4}
        return httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60).json()["usage"]["prompt_tokens"]

    one, per = prompt_tokens(max_frames=1), prompt_tokens(max_frames=2) - prompt_tokens(max_frames=1)
    # 25 s at 2 fps would be 50 frames: sampled down to max_chat_video_frames=16 (each frame: its
    # image tokens and a time marker of a token or two more or less than the second frame's)
    frames = 1 + (prompt_tokens() - one) / per
    assert abs(frames - 16) < 1, (frames, one, per)


@pytest.mark.parametrize(
    "part_extra, url, param, words",
    [
        ({}, "data:video/mp4;base64," + base64.b64encode(b"not a video" * 50).decode(), "video_url", "decodable"),
        ({}, "http://10.0.0.1/a.mp4", "video_url", "nothing is fetched"),
        ({}, "file-" + "x" * 20, "video_url", "no such file"),
        ({"max_frames": 17}, None, "max_frames", "max_chat_video_frames"),
        ({}, "big", "video_url", f"at most {64 * 64} pixels"),
    ],
)
def test_bad_videos_are_4xx_naming_the_part(video_server, scene_clip, part_extra, url, param, words):
    from PIL import Image

    base, _ = video_server
    if url is None:
        url = mp4_url(scene_clip)
    elif url == "big":  # frames over max_chat_video_pixels
        url = mp4_url(clip([Image.new("RGB", (96, 96), (200, 10, 10))] * 4))
    resp = httpx.post(f"{base}/v1/chat/completions", json={"messages": video_user(url, **part_extra)}, timeout=60)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == f"messages[0].content[0].{param}" and words in error["message"], error


def test_a_completed_video_job_and_a_file_id_are_videos_to_chat_about(video_server, scene_clip):
    from triptych.head.jobs import VideoRecord

    base, head = video_server
    job_id = "video_" + "ab" * 12
    head.videos.store.insert(
        VideoRecord(job_id, 0, "completed", 100, "default_edit", "p", "64x64", "3", 24, completed_at=0)
    )
    head.videos.path(job_id).write_bytes(scene_clip)
    by_data = httpx.post(
        f"{base}/v1/chat/completions", json={"messages": video_user(mp4_url(scene_clip)), "max_tokens": 8}
    ).json()
    by_job = httpx.post(f"{base}/v1/chat/completions", json={"messages": video_user(job_id), "max_tokens": 8}).json()
    assert by_job["choices"][0]["message"] == by_data["choices"][0]["message"]
    assert by_job["usage"] == by_data["usage"]
    file_id, _ = head.files.put(scene_clip, "mp4")
    by_file = httpx.post(f"{base}/v1/chat/completions", json={"messages": video_user(file_id), "max_tokens": 8}).json()
    assert by_file["usage"] == by_data["usage"]
    png_id, _ = head.files.put(b"\x89PNG", "png")
    resp = httpx.post(f"{base}/v1/chat/completions", json={"messages": video_user(png_id)})
    assert resp.status_code == 400 and "not a video/mp4" in resp.json()["error"]["message"]
    head.videos.store.update(job_id, status="in_progress")
    resp = httpx.post(f"{base}/v1/chat/completions", json={"messages": video_user(job_id)})
    assert resp.status_code == 400 and "not completed" in resp.json()["error"]["message"]
