"""Several models behind one head over fake backends (no model compute): each request reaches its
model's backend, each model admits against its own queue limit, and an error is counted under the
model the request went to."""

from __future__ import annotations

import re
import threading

import httpx

from tests.e2e.http_support import FakeBackend, FakeFamily, png_bytes, serve, wait_for
from triptych.head.admission import AdmissionLimits
from triptych.head.app import HeadConfig, create_app


def make_server(tmp_path, **limits):
    backends = {
        "t2i": FakeBackend(FakeFamily(tmp_path / "t2i")),
        "edit": FakeBackend(FakeFamily(tmp_path / "edit", accepts_image=True, requires_image=True), gated=True),
        "vid": FakeBackend(FakeFamily(tmp_path / "vid", is_video=True)),
    }
    config = HeadConfig(data_dir=tmp_path / "data", limits=AdmissionLimits(**limits))
    return backends, serve(create_app(backends, config))


def count(text: str, endpoint: str, model: str, outcome: str) -> float:
    series = f'triptych_requests_total{{endpoint="{endpoint}",model="{model}",outcome="{outcome}"}} (\\S+)'
    found = re.search(series, text)
    return float(found.group(1)) if found else 0.0


def test_each_request_reaches_its_models_backend(tmp_path):
    backends, server = make_server(tmp_path)
    backends["edit"].gated = False
    with server as base:
        assert httpx.post(f"{base}/v1/images/generations", json={"prompt": "a"}).status_code == 200
        edit = httpx.post(f"{base}/v1/images/edits", data={"prompt": "b"}, files={"image": ("a.png", png_bytes())})
        assert edit.status_code == 200, edit.text
        video = httpx.post(f"{base}/v1/videos", json={"prompt": "c"}).json()
        assert video["model"] == "vid"
        wait_for(lambda: httpx.get(f"{base}/v1/videos/{video['id']}").json()["status"] == "completed", "video")
        named = httpx.post(f"{base}/v1/images/generations", json={"prompt": "d", "model": "edit"})
        assert named.status_code == 400 and named.json()["error"]["param"] == "image"  # the edit model needs one
    prompts = {name: [j.params.prompt for j in b.jobs] for name, b in backends.items()}
    assert prompts == {"t2i": ["a"], "edit": ["b"], "vid": ["c"]}


def test_admission_is_per_model_and_errors_count_under_the_routed_model(tmp_path):
    backends, server = make_server(tmp_path, max_queued_requests=1, max_n=1)
    with server as base:
        url = f"{base}/v1/images/edits"
        holder: list = []

        def first():
            holder.append(httpx.post(url, data={"prompt": "x"}, files={"image": ("a.png", png_bytes())}, timeout=60))

        thread = threading.Thread(target=first, daemon=True)
        thread.start()
        wait_for(lambda: backends["edit"].running, "the edit model's one slot taken")
        full = httpx.post(url, data={"prompt": "y"}, files={"image": ("a.png", png_bytes())})
        assert full.status_code == 429
        other = httpx.post(f"{base}/v1/images/generations", json={"prompt": "z"})
        assert other.status_code == 200  # the text-to-image model's queue is its own
        bad = httpx.post(f"{base}/v1/images/generations", json={"prompt": "z", "size": "33x33"})
        assert bad.status_code == 400
        unparsed = httpx.post(f"{base}/v1/images/generations", json={"prompt": "z", "n": "many"})
        assert unparsed.status_code == 400
        health = httpx.get(f"{base}/health").json()
        assert {n: m["in_flight"] for n, m in health["models"].items()} == {"t2i": 0, "edit": 1, "vid": 0}
        backends["edit"].open_gate()
        thread.join(60)
        assert holder[0].status_code == 200
        text = httpx.get(f"{base}/metrics").text
    assert count(text, "/v1/images/edits", "edit", "overloaded") == 1
    assert count(text, "/v1/images/edits", "t2i", "overloaded") == 0
    assert count(text, "/v1/images/generations", "t2i", "invalid") == 1
    assert count(text, "/v1/images/generations", "", "invalid") == 1  # refused before routing: no model
