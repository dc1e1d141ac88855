"""Admission, uploads, disconnects and error mapping, over a fake backend (no model compute)."""

from __future__ import annotations

import asyncio
import base64
import socket
import threading

import httpx
import openai
import pytest

from tests.e2e.http_support import FakeBackend, FakeFamily, decode_pixels, png_bytes, serve, wait_for
from triptych.control.backend import StageFailed
from triptych.head.admission import AdmissionLimits
from triptych.head.app import HeadConfig, create_app


def make_server(tmp_path, gated=False, requires_image=True, **limits):
    family = FakeFamily(tmp_path / "edit-model", accepts_image=True, requires_image=requires_image)
    backend = FakeBackend(family, gated=gated)
    limits = AdmissionLimits(**{"max_queued_requests": 4, "max_n": 2, **limits})
    return backend, serve(create_app(backend, HeadConfig(data_dir=tmp_path / "data", limits=limits)))


def post_async(url, **kw):
    """POST in a thread; returns (thread, holder) where holder[0] becomes the response."""
    holder: list = []
    thread = threading.Thread(target=lambda: holder.append(httpx.post(url, timeout=60, **kw)), daemon=True)
    thread.start()
    return thread, holder


def test_queue_full_is_429_with_retry_after(tmp_path):
    backend, server = make_server(tmp_path, gated=True, max_queued_requests=2, retry_after_s=2.5)
    with server as base:
        url = f"{base}/v1/images/edits"
        form = {"data": {"prompt": "x", "n": "2"}, "files": {"image": ("a.png", png_bytes())}}
        thread, holder = post_async(url, **form)
        wait_for(lambda: len(backend.running) == 2, "two jobs running")
        resp = httpx.post(url, data={"prompt": "y"}, files={"image": ("a.png", png_bytes())})
        assert resp.status_code == 429
        assert resp.headers["retry-after"] == "3"
        assert resp.json()["error"]["type"] == "rate_limit_error"
        assert "max_queued_requests=2" in resp.json()["error"]["message"]
        backend.open_gate()
        thread.join(60)
        assert holder[0].status_code == 200 and len(holder[0].json()["data"]) == 2


def test_openai_client_sees_rate_limit_error(tmp_path):
    backend, server = make_server(tmp_path, gated=True, max_queued_requests=1, max_n=1)
    with server as base:
        thread, _ = post_async(f"{base}/v1/images/edits", data={"prompt": "x"}, files={"image": ("a.png", png_bytes())})
        wait_for(lambda: backend.running, "first job running")
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.RateLimitError):
            client.images.edit(image=("a.png", png_bytes()), prompt="y")
        backend.open_gate()
        thread.join(60)


def test_client_disconnect_cancels_the_job(tmp_path):
    backend, server = make_server(tmp_path, gated=True, requires_image=False)
    with server as base:
        port = int(base.rsplit(":", 1)[1])
        body = b'{"prompt": "a cat", "seed": 3}'
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(
                b"POST /v1/images/generations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
            )
            job_id = wait_for(lambda: next(iter(backend.running), None), "job running")
        wait_for(lambda: job_id in backend.cancelled, "cancel after disconnect")
        wait_for(lambda: httpx.get(f"{base}/health").json()["in_flight"] == 0, "admission slot released")


def test_edit_with_fake_image_family_passes_params(tmp_path):
    backend, server = make_server(tmp_path)
    with server as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        out = client.images.edit(
            image=("a.png", png_bytes()),
            prompt="blue",
            n=2,
            size="48x32",
            extra_body={"seed": 5, "true_cfg_scale": 2.0, "num_inference_steps": 3},
        )
        assert len(out.data) == 2 and out.size == "48x32"
        params = [j.params for j in backend.jobs]
        assert [p.seed for p in params] == [5, 6]
        assert {(p.teacache_threshold, p.true_cfg, p.steps, p.width, p.height) for p in params} == {
            (0.0, 2.0, 3, 48, 32)
        }
        assert params[0].image.size == (32, 32)
        # A family without a TeaCache plan refuses a threshold at the door (pass-through on a real
        # family: tests/pipelines/test_engine_teacache.py).
        with pytest.raises(openai.BadRequestError) as err:
            client.images.edit(image=("a.png", png_bytes()), prompt="blue", extra_body={"teacache_threshold": 0.3})
        assert err.value.body["param"] == "teacache_threshold"
        assert len(backend.jobs) == 2


@pytest.mark.parametrize(
    "payload, needle",
    [(b"", "empty"), (b"not an image at all", "decodable"), (png_bytes(64, 64), "pixels"), (b"x" * 5000, "bytes")],
)
def test_bad_uploads_are_400(tmp_path, payload, needle):
    backend, server = make_server(tmp_path, max_upload_bytes=4096, max_upload_pixels=48 * 48)
    with server as base:
        resp = httpx.post(f"{base}/v1/images/edits", data={"prompt": "x"}, files={"image": ("a.png", payload)})
        assert resp.status_code == 400, resp.text
        err = resp.json()["error"]
        assert err["param"] == "image" and needle in err["message"]
        assert not backend.jobs


def test_huge_body_is_refused_before_reading(tmp_path):
    backend, server = make_server(tmp_path, max_upload_bytes=1024)
    with server as base:
        big = b"\0" * (6 * 1024 * 1024)
        resp = httpx.post(f"{base}/v1/images/edits", data={"prompt": "x"}, files={"image": ("a.png", big)})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "image"


def test_form_fields_are_validated(tmp_path):
    backend, server = make_server(tmp_path)
    with server as base:
        for data, param in [
            ({"prompt": "x", "n": "two"}, "n"),
            ({"prompt": "x", "size": "65x64"}, "size"),
            ({"prompt": "x", "bogus": "1"}, "bogus"),
            ({"n": "1"}, "prompt"),
        ]:
            resp = httpx.post(f"{base}/v1/images/edits", data=data, files={"image": ("a.png", png_bytes())})
            assert resp.status_code == 400 and resp.json()["error"]["param"] == param, (data, resp.text)
        resp = httpx.post(f"{base}/v1/images/edits", files=[("prompt", (None, "x"))])  # multipart, no image
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "image"
        resp = httpx.post(f"{base}/v1/images/edits", data={"prompt": "x"})  # urlencoded: a cross-site form
        assert resp.status_code == 415


def test_stage_failure_is_502_not_bad_input(tmp_path):
    backend, server = make_server(tmp_path)

    async def failing_run(job, on_progress=None):
        raise StageFailed("decoder instance dec-0 died; retries exhausted")

    backend.run = failing_run
    with server as base:
        resp = httpx.post(f"{base}/v1/images/edits", data={"prompt": "x"}, files={"image": ("a.png", png_bytes())})
        assert resp.status_code == 502
        assert resp.json()["error"]["type"] == "server_error" and "dec-0 died" in resp.json()["error"]["message"]


def test_lifespan_starts_and_closes_backend(tmp_path):
    backend, server = make_server(tmp_path)
    with server:
        assert backend.lifecycle == ["start"]
    assert backend.lifecycle == ["start", "close"]


def test_a_size_over_the_token_limit_is_400_before_any_worker(tmp_path):
    """max_tokens counts the model's tokens (the fake family: 16 px per token side); 64x64 = 16 tokens."""
    backend, server = make_server(tmp_path, max_tokens=16)
    with server as base:
        files = {"image": ("a.png", png_bytes())}
        ok = httpx.post(f"{base}/v1/images/edits", data={"prompt": "x", "size": "64x64"}, files=files)
        assert ok.status_code == 200, ok.text
        resp = httpx.post(f"{base}/v1/images/edits", data={"prompt": "x", "size": "80x64"}, files=files)
        assert resp.status_code == 400
        error = resp.json()["error"]
        assert error["param"] == "size" and "20 transformer tokens" in error["message"]
        assert "limit of 16" in error["message"]
        assert len(backend.jobs) == 1  # only the accepted request reached the backend


def sse_events(lines) -> list[tuple[str, dict]]:
    """(event, data) pairs of a server-sent event stream's lines."""
    import json

    events, name = [], None
    for line in lines:
        if line.startswith("event: "):
            name = line[len("event: ") :]
        elif line.startswith("data: "):
            events.append((name, json.loads(line[len("data: ") :])))
    return events


def test_streamed_edit_sends_image_edit_events(tmp_path):
    backend, server = make_server(tmp_path)
    with server as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        stream = client.images.edit(
            image=("a.png", png_bytes()), prompt="blue", stream=True, partial_images=2, extra_body={"seed": 5}
        )
        events = list(stream)
    assert [e.type for e in events] == ["image_edit.partial_image"] * 2 + ["image_edit.completed"]
    assert [decode_pixels(base64.b64decode(e.b64_json))[0, 0, 0] for e in events] == [6, 7, 5]
    assert backend.jobs[0].partial_images == 2


def test_stream_disconnect_after_a_partial_cancels_the_job(tmp_path):
    backend, server = make_server(tmp_path, gated=True, requires_image=False)
    with server as base:
        body = {"prompt": "a cat", "seed": 3, "stream": True, "partial_images": 2}
        with httpx.stream("POST", f"{base}/v1/images/generations", json=body, timeout=60) as resp:
            assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
            lines = resp.iter_lines()
            first = sse_events(next(lines) for _ in range(2))  # the first event, then hang up
        assert first[0][0] == "image_generation.partial_image" and first[0][1]["partial_image_index"] == 0
        job_id = backend.jobs[0].request_id
        wait_for(lambda: job_id in backend.cancelled, "cancel after disconnect")
        wait_for(lambda: httpx.get(f"{base}/health").json()["in_flight"] == 0, "admission slot released")


def test_stream_failure_after_the_headers_is_an_error_event(tmp_path):
    backend, server = make_server(tmp_path, requires_image=False)

    async def fail(job, on_progress=None, on_preview=None):
        on_preview(0, png_bytes())
        await asyncio.sleep(0)
        raise StageFailed("decoder exploded")

    backend.run = fail
    with server as base:
        body = {"prompt": "a cat", "stream": True, "partial_images": 1}
        with httpx.stream("POST", f"{base}/v1/images/generations", json=body, timeout=60) as resp:
            events = sse_events(resp.iter_lines())
        assert [name for name, _ in events] == ["image_generation.partial_image", "error"]
        assert "decoder exploded" in events[1][1]["error"]["message"]
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.APIError, match="decoder exploded"):
            list(client.images.generate(prompt="x", stream=True, partial_images=1))
        wait_for(lambda: httpx.get(f"{base}/health").json()["in_flight"] == 0, "admission slot released")


def test_a_stream_nobody_reads_holds_neither_its_job_nor_the_head(tmp_path):
    import numpy as np

    from triptych.core.media import encode_image

    backend, server = make_server(tmp_path, requires_image=False)
    noise = encode_image(np.random.default_rng(0).integers(0, 256, (1024, 1024, 3), dtype=np.uint8), "png")
    finished: list[str] = []

    async def run(job, on_progress=None, on_preview=None):
        for index in range(job.partial_images):
            on_preview(index, noise)  # ~3 MB each: more than the socket buffers take
        finished.append(job.request_id)
        return noise

    backend.run = run
    with server as base:
        port = int(base.rsplit(":", 1)[1])
        body = b'{"prompt": "a cat", "stream": true, "partial_images": 3}'
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.sendall(
                b"POST /v1/images/generations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
            )  # and never read
            wait_for(lambda: finished, "the job to end while its client reads nothing")
            assert httpx.get(f"{base}/health").json()["in_flight"] == 1  # the stream still holds its slot
            plain = httpx.post(f"{base}/v1/images/generations", json={"prompt": "a dog"}, timeout=60)
            assert plain.status_code == 200 and len(finished) == 2
        wait_for(lambda: httpx.get(f"{base}/health").json()["in_flight"] == 0, "admission slot released")
