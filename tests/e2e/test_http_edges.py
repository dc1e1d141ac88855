"""The head's leftover edges (issue 24, item 7), over a fake backend: echoed values are cut, the
head's state is owner-only, whitespace-only chat text and sub-frame video lengths are refused, url
links do not follow a client's Host header, and connections that never finish their headers are
closed. Each fails on the head before its change."""

from __future__ import annotations

import httpx

from tests.e2e.http_support import FakeBackend, FakeFamily, serve
from triptych.errors import InvalidParam
from triptych.server.http import HeadConfig, create_app

LONG = "a" * 10_000


def make_server(tmp_path, backend=None, **config):
    backend = backend or FakeBackend(FakeFamily(tmp_path / "model"))
    return backend, serve(create_app(backend, HeadConfig(data_dir=tmp_path / "data", **config)))


def video_server(tmp_path, **config):
    return make_server(tmp_path, FakeBackend(FakeFamily(tmp_path / "model", is_video=True)), **config)


# ---- echoed values are cut ---------------------------------------------------------------------
def assert_cut(message: str) -> None:
    assert "(10000 chars)" in message and len(message) < 400, message[:500]


def test_a_10000_character_video_id_is_not_echoed_whole(tmp_path):
    _, server = video_server(tmp_path)
    with server as base:
        got = httpx.get(f"{base}/v1/videos/{LONG}")
        deleted = httpx.delete(f"{base}/v1/videos/{LONG}")
        content = httpx.get(f"{base}/v1/files/{LONG}/content")
    for resp in (got, deleted, content):
        assert resp.status_code == 404
        assert_cut(resp.json()["error"]["message"])


def test_a_10000_character_model_name_or_field_name_is_not_echoed_whole(tmp_path):
    _, server = make_server(tmp_path)
    with server as base:
        model = httpx.post(f"{base}/v1/images/generations", json={"prompt": "x", "model": LONG})
        field = httpx.post(f"{base}/v1/images/generations", json={"prompt": "x", LONG: 1})
        value = httpx.post(f"{base}/v1/images/generations", json={"prompt": "x", "style": LONG})
    assert model.status_code == 404
    assert_cut(model.json()["error"]["message"])
    for resp in (field, value):
        assert resp.status_code == 400
        assert_cut(resp.json()["error"]["message"])
    assert len(field.json()["error"]["param"]) < 100


def test_invalid_param_messages_cut_the_value_but_keep_it_whole_on_the_exception():
    err = InvalidParam("prompt", LONG, "is too long")
    assert err.value == LONG
    assert_cut(str(err))
    assert str(InvalidParam("n", 11, "must be between 1 and 10")) == "invalid n=11: must be between 1 and 10"
