"""A request lives until it is answered, its client disconnects or its deadline passes (issue 24,
item 1): the body-read timeout covers reading the body only.

Over the fake backend (gated: a job waits until the test opens the gate) and a head whose body-read
timeout is 0.5 s: images, edits, streams and chats that take longer are answered 200; a request past
``request_timeout_s`` is a 504 naming it, and its job is cancelled; a role with no live instance is
a 503 with ``Retry-After`` (a real orchestrator without workers), not a 499 at the body timeout.
Each fails on the head before this change (499 "client disconnected", or a stream cut, at 0.5 s).
"""

from __future__ import annotations

import concurrent.futures
import json

import httpx
import pytest

from tests.e2e.http_support import CHAT_ANSWER, FakeBackend, FakeFamily, png_bytes, serve, wait_for
from triptych.head.app import HeadConfig, create_app

BODY_TIMEOUT_S = 0.5
CHAT = {"messages": [{"role": "user", "content": "what is drawn?"}]}


def _images(base: str) -> httpx.Response:
    return httpx.post(f"{base}/v1/images/generations", json={"prompt": "a red circle", "seed": 3}, timeout=120)


def _edits(base: str) -> httpx.Response:
    files = {"image": ("a.png", png_bytes(), "image/png")}
    return httpx.post(f"{base}/v1/images/edits", data={"prompt": "make it blue", "seed": 3}, files=files, timeout=120)


def _image_stream(base: str, previews: int) -> httpx.Response:
    body = {"prompt": "a red circle", "seed": 3, "stream": True, "partial_images": previews}
    return httpx.post(f"{base}/v1/images/generations", json={k: v for k, v in body.items() if v}, timeout=120)


def _chat(base: str, stream: bool = False) -> httpx.Response:
    return httpx.post(f"{base}/v1/chat/completions", json={**CHAT, "stream": stream}, timeout=120)


def _sse_data(resp: httpx.Response) -> list[dict | str]:
    out = []
    for line in resp.text.splitlines():
        if line.startswith("data: "):
            out.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
    return out


def _check_images(resp: httpx.Response) -> None:
    assert resp.json()["seeds"] == [3] and resp.json()["data"][0]["b64_json"]


def _check_image_stream(resp: httpx.Response) -> None:
    events = _sse_data(resp)
    assert events[-1]["type"] == "image_generation.completed" and events[-1]["b64_json"], events[-1]


def _check_chat(resp: httpx.Response) -> None:
    assert resp.json()["choices"][0]["message"]["content"] == CHAT_ANSWER


def _check_chat_stream(resp: httpx.Response) -> None:
    events = _sse_data(resp)
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1] if e["choices"])
    assert text == CHAT_ANSWER and events[-1] == "[DONE]", events


#: (name, request, check of the 200). The streams: one whose first event waits for the gate, one
#: (a preview, a first chat piece) that sends its headers and first event, then waits.
KINDS = {
    "images": (_images, _check_images),
    "edits": (_edits, _check_images),
    "image-stream-before-first-event": (lambda b: _image_stream(b, 0), _check_image_stream),
    "image-stream-after-a-preview": (lambda b: _image_stream(b, 1), _check_image_stream),
    "chat": (_chat, _check_chat),
    "chat-stream": (lambda b: _chat(b, stream=True), _check_chat_stream),
}


def _app(tmp_path, **config):
    backend = FakeBackend(FakeFamily(tmp_path / "model", accepts_image=True, chat=True), gated=True)
    app = create_app(backend, HeadConfig(data_dir=tmp_path / "data", body_read_timeout_s=BODY_TIMEOUT_S, **config))
    return backend, app


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_request_slower_than_the_body_timeout_is_answered(tmp_path, kind):
    send, check = KINDS[kind]
    backend, app = _app(tmp_path)
    with serve(app) as base, concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(send, base)
        wait_for(lambda: backend.running, "the job to reach the backend")
        # Nothing may come back while the backend works: the old head answered 499 (or cut the
        # stream) at the 0.5 s body timeout. Eight body timeouts without an answer, then the gate.
        with pytest.raises(concurrent.futures.TimeoutError):
            pending.result(timeout=8 * BODY_TIMEOUT_S)
        backend.open_gate()
        resp = pending.result(timeout=120)
        assert resp.status_code == 200, resp.text
        check(resp)
        assert backend.cancelled == []
        assert httpx.get(f"{base}/health").json()["in_flight"] == 0


@pytest.mark.parametrize("kind", ["images", "image-stream-before-first-event", "chat", "chat-stream"])
def test_a_request_past_its_deadline_is_a_504_naming_it_and_its_job_is_cancelled(tmp_path, kind):
    send, _ = KINDS[kind]
    backend, app = _app(tmp_path, request_timeout_s=1.0)
    if kind == "chat-stream":  # its first piece would open the stream: the deadline covers the wait for it
        backend.chat_first_piece = False
    with serve(app) as base:
        resp = send(base)  # the gate never opens
        assert resp.status_code == 504, resp.text
        error = resp.json()["error"]
        assert "request_timeout_s" in error["message"] and "--request-timeout-s" in error["message"], error
        assert error["code"] == "timeout"
        wait_for(lambda: not backend.running, "the backend's job to end")
        assert len(backend.cancelled) == 1
        assert httpx.get(f"{base}/health").json()["in_flight"] == 0
        metrics = httpx.get(f"{base}/metrics").text
        assert 'outcome="timed_out"' in metrics


@pytest.mark.parametrize("kind", ["images", "edits", "image-stream-before-first-event"])
def test_the_head_hands_each_job_its_requests_deadline(tmp_path, kind):
    """``GenerationJob.deadline``: ``request_timeout_s`` from the request's start, on the monotonic
    clock (a retry waiting for a replacement worker gives up then)."""
    import time

    send, check = KINDS[kind]
    backend = FakeBackend(FakeFamily(tmp_path / "model", accepts_image=True, chat=True))
    app = create_app(backend, HeadConfig(data_dir=tmp_path / "data", request_timeout_s=1000.0))
    with serve(app) as base:
        before = time.monotonic()
        resp = send(base)
        after = time.monotonic()
    assert resp.status_code == 200, resp.text
    check(resp)
    (job,) = backend.jobs
    assert before + 1000.0 <= job.deadline <= after + 1000.0


def test_request_timeout_s_is_checked():
    with pytest.raises(ValueError, match="request_timeout_s"):
        HeadConfig(data_dir="x", request_timeout_s=0)


def test_a_role_without_a_live_instance_is_a_503_with_retry_after_past_the_body_timeout(tmp_path, tiny_model_dir):
    """A real orchestrator with no worker at all: a request queued while the grace runs fails when it
    runs out (3 s, six body timeouts) with 503 + Retry-After; one sent after it, at once, the same."""
    from triptych.control.orchestrator import Orchestrator, OrchestratorConfig

    backend = Orchestrator(tiny_model_dir("flux"), OrchestratorConfig(unavailable_after_s=3.0))
    config = HeadConfig(data_dir=tmp_path / "data", body_read_timeout_s=BODY_TIMEOUT_S)
    with serve(create_app(backend, config)) as base:
        for role in ("encoder", "denoiser", "decoder"):
            backend.registry.expect(role)  # the grace starts now: the next request is queued first
        for attempt in ("queued", "after the grace"):
            resp = httpx.post(f"{base}/v1/images/generations", json={"prompt": "a red circle"}, timeout=120)
            assert resp.status_code == 503, (attempt, resp.status_code, resp.text)
            assert resp.headers["retry-after"] == "5" and "no live instance" in resp.json()["error"]["message"]
        assert backend.describe()["requests"] == {} and httpx.get(f"{base}/health").json()["in_flight"] == 0
