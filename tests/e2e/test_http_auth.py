"""API keys: the OpenAI SDK's bearer token is checked on every API route; health, metrics and
handed-out file links stay open; a wrong or missing key is a 401 in OpenAI's error shape."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.e2e.http_support import FakeBackend, FakeFamily, serve
from triptych.head.app import HeadConfig, create_app

KEYS = ("sk-first-key-0001", "sk-second-key-002")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    backend = FakeBackend(FakeFamily(tmp_path_factory.mktemp("model")))
    app = create_app(backend, HeadConfig(data_dir=tmp_path_factory.mktemp("data"), api_keys=KEYS))
    with serve(app) as base:
        yield base, backend


def client(base, key):
    return openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0)


def test_each_configured_key_is_accepted(server):
    base, backend = server
    for key in KEYS:
        out = client(base, key).images.generate(prompt="a boat", response_format="url", extra_body={"seed": 1})
        assert out.data[0].url
    assert [j.params.seed for j in backend.jobs[-2:]] == [1, 1]
    link = httpx.get(out.data[0].url)  # a handed-out link works without the key, like a pre-signed URL
    assert link.status_code == 200 and link.content[:4] == b"\x89PNG"


def test_wrong_or_missing_key_is_401_and_nothing_runs(server):
    base, backend = server
    before = len(backend.jobs)
    with pytest.raises(openai.AuthenticationError) as e:
        client(base, "sk-not-a-key-999").images.generate(prompt="a boat")
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
    assert "invalid API key" in e.value.body["message"]
    for headers in ({}, {"Authorization": "Basic c2stZmlyc3Q="}, {"Authorization": "Bearer"}):
        resp = httpx.post(f"{base}/v1/images/generations", json={"prompt": "x"}, headers=headers)
        assert resp.status_code == 401 and resp.headers["www-authenticate"] == "Bearer", resp.text
        assert "missing API key" in resp.json()["error"]["message"]
    assert httpx.get(f"{base}/v1/models").status_code == 401
    assert httpx.get(f"{base}/v1/videos").status_code == 401
    assert httpx.get(f"{base}/v1/loras").status_code == 401
    assert httpx.post(f"{base}/v1/loras", json={"name": "x", "path": "x"}).status_code == 401
    assert httpx.delete(f"{base}/v1/loras/x").status_code == 401
    ok = httpx.get(f"{base}/v1/loras", headers={"Authorization": f"Bearer {KEYS[0]}"})
    assert ok.status_code == 200 and ok.json()["data"] == [], ok.text
    assert len(backend.jobs) == before


def test_health_and_metrics_stay_open(server):
    base, _ = server
    assert httpx.get(f"{base}/health").status_code == 200
    assert httpx.get(f"{base}/metrics").status_code == 200


def test_short_keys_are_refused_at_startup(tmp_path):
    with pytest.raises(ValueError, match="at least 8 characters"):
        HeadConfig(data_dir=tmp_path, api_keys=("short",))
