"""The browser playground at ``/``: served without the API key, and driven by headless Chromium
against a served tiny model: it reads ``/v1/models``, streams one generation with the key typed in
(``?key=``), shows the partial images and loads the final image (``?autorun=1`` marks the page
``data-state="done"`` when the result image has loaded; ``--dump-dom`` prints the page then)."""

from __future__ import annotations

import os
import re
import signal
import subprocess

import httpx
import pytest

from tests.e2e.http_support import serve
from tests.extras import chromium, needs_extra
from triptych.control.backend import InProcessBackend
from triptych.families.registry import load_family
from triptych.head.app import HeadConfig, create_app

KEY = "playground-key-123"
CHROMIUM = chromium()


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    backend = InProcessBackend(load_family(tiny_model_dir("flux")))
    config = HeadConfig(data_dir=tmp_path_factory.mktemp("playground"), api_keys=(KEY,))
    with serve(create_app(backend, config)) as base:
        yield base


def test_page_is_served_without_the_key_and_uses_the_public_api(server):
    page = httpx.get(f"{server}/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    for route in ("/v1/models", "/v1/images/generations", "/v1/images/edits", "/v1/videos", "/v1/chat/completions"):
        assert route in page.text, route
    assert "Bearer " in page.text
    assert httpx.get(f"{server}/v1/models").status_code == 401  # the API itself still needs it
    schema = httpx.get(f"{server}/openapi.json", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert "/" not in schema["paths"]  # a page, not an API route


def dump_dom(url: str, profile) -> str:
    """The page's DOM after it settled, from headless Chromium (its process group ended if it hangs)."""
    args = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={profile}"]
    args += ["--virtual-time-budget=120000", "--dump-dom", url]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return out.decode()


@needs_extra("chromium")
def test_browser_streams_a_generation_and_loads_the_result(server, tmp_path):
    query = f"autorun=1&key={KEY}&prompt=a+red+cube&size=64x48&steps=4&seed=5&partial_images=2"
    dom = dump_dom(f"{server}/?{query}", tmp_path / "profile")
    body = re.search(r"<body[^>]*>", dom).group(0)
    assert 'data-state="done"' in body, dom[-2000:]
    assert 'data-partials="2"' in body
    assert len(re.findall(r'class="frame preview"', dom)) == 2
    result = re.search(r'<img id="result"[^>]*>', dom).group(0)
    assert 'data-natural-width="64"' in result and 'data-natural-height="48"' in result and "blob:" in result
    assert re.search(r'<option value="([^"]+)">\1 \(image\)</option>', dom)  # the list from /v1/models


@needs_extra("chromium")
def test_browser_without_the_key_shows_the_401(server, tmp_path):
    dom = dump_dom(f"{server}/?autorun=1", tmp_path / "profile")
    status = re.search(r'<div id="status"[^>]*>([^<]*)</div>', dom).group(1)
    assert status.startswith("models: missing API key"), status
    assert 'data-state="error"' in dom
