"""Streamed image generation (``stream=true``, ``partial_images``) through the official ``openai``
client against the embedded disaggregated server: previews decoded by the decoder pool from the
denoiser's predicted clean latents, then the final image, bit-identical to the non-streamed one."""

from __future__ import annotations

import base64
import io
import json
import logging
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from tests.e2e.http_support import FakeBackend, FakeFamily, decode_pixels, serve
from triptych.core.startup import STARTUP_LOGGER
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
    startup = logging.getLogger(STARTUP_LOGGER)
    level, lines = startup.level, LinesHandler()
    startup.setLevel(logging.INFO)  # as triptych serve sets it
    startup.addHandler(lines)
    try:
        with serve(app) as base:
            client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
            client.startup_lines, client.startup_model = lines.lines, Path(tiny_model_dir("flux")).name
            yield client
    finally:
        startup.removeHandler(lines)
        startup.setLevel(level)


class LinesHandler(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def test_startup_says_each_workers_loading_and_the_models_readiness(client):
    lines = client.startup_lines
    model = client.startup_model
    for role in ("encoder", "denoiser", "decoder"):
        loading = [line for line in lines if line.startswith(f"{model}: {role} worker ") and "loading" in line]
        ready = [line for line in lines if line.startswith(f"{model}: {role} worker ") and "ready" in line]
        assert len(loading) == 1 and len(ready) == 1, lines
        assert lines.index(loading[0]) < lines.index(ready[0])
    assert lines[-1].startswith(f"{model} ready: 3 workers in "), lines


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
    """Previews are best-effort (a late or lost one is dropped, the next takes its number: the
    fake-backend tests below): at most ``partials`` of them, numbered from 0 without a gap, then the
    image. On an idle machine all of them come; a loaded one can lose one."""
    events = list(generate(client, seed=13, stream=True, partial_images=partials))
    indices = [getattr(e, "partial_image_index", None) for e in events]
    assert indices[-1] is None and events[-1].type == "image_generation.completed"
    assert indices[:-1] == list(range(len(indices) - 1)) and len(indices) - 1 <= partials, indices


def test_partial_images_out_of_range_is_a_400_naming_it(client):
    with pytest.raises(openai.BadRequestError) as err:
        generate(client, seed=1, stream=True, partial_images=4)
    assert err.value.body["param"] == "partial_images" and "partial_images=4" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        generate(client, seed=1, partial_images=2)
    assert err.value.body["param"] == "partial_images" and "stream=true" in err.value.body["message"]


# ---- over a fake backend: partial indices without gaps; a shape-world model's unknown-word warning ---
class ReorderingBackend(FakeBackend):
    """Hands a job's previews over in ``order`` (backend indices; one left out is lost in transfer),
    after the job's own run, as previews decoded late or lost do."""

    order: list[int] = []

    async def run(self, job, on_progress=None, on_preview=None):
        held: dict[int, bytes] = {}
        out = await super().run(job, on_progress, held.__setitem__ if on_preview else None)
        for index in self.order if on_preview else ():
            on_preview(index, held[index])
        return out


@pytest.fixture(scope="module")
def shapes_server(tmp_path_factory):
    import json

    tmp = tmp_path_factory.mktemp("stream-fake")
    (tmp / "model").mkdir()
    (tmp / "model" / "triptych.json").write_text(json.dumps({"prompt_normaliser": "shapes"}))
    backend = ReorderingBackend(FakeFamily(tmp / "model"))
    with serve(create_app(backend, HeadConfig(data_dir=tmp / "data"))) as base:
        yield backend, base


def stream_events(base, prompt="a red circle on a blue background", partials=3):
    body = {"prompt": prompt, "stream": True, "partial_images": partials}
    with httpx.stream("POST", f"{base}/v1/images/generations", json=body) as resp:
        lines = [line for line in resp.iter_lines() if line.startswith("data: ")]
        return resp.headers, [json.loads(line[len("data: ") :]) for line in lines]


@pytest.mark.parametrize("order", [[0, 2, 1], [0, 2], [1, 2]])
def test_partial_images_are_numbered_without_gaps(shapes_server, order):
    """A preview decoded after a newer one (0, 2, 1), or lost (0, 2), is not sent and leaves no gap."""
    backend, base = shapes_server
    backend.order = order
    _, events = stream_events(base)
    sent = [e["partial_image_index"] for e in events if e["type"].endswith("partial_image")]
    assert sent == [0, 1] and events[-1]["type"] == "image_generation.completed", events


def test_a_prompt_outside_the_models_words_is_warned_of(shapes_server, caplog):
    backend, base = shapes_server
    backend.order = []
    with caplog.at_level("WARNING", logger="triptych.head.state"):
        odd = httpx.post(f"{base}/v1/images/generations", json={"prompt": "draw a blue triangle on a white background"})
    known = httpx.post(f"{base}/v1/images/generations", json={"prompt": "a blue triangle on a white background"})
    headers, _ = stream_events(base, prompt="paint a red circle on a blue background", partials=0)
    assert odd.status_code == 200 and known.status_code == 200, odd.text
    (note,) = odd.json()["warnings"]
    assert "'draw'" in note and "try 'a blue triangle on a white background'" in note, note
    assert odd.headers["x-triptych-warning"] == note and "x-triptych-warning" not in known.headers
    assert known.json()["warnings"] is None
    assert "'paint'" in headers["x-triptych-warning"]
    assert any("'draw'" in r.getMessage() for r in caplog.records), caplog.records
