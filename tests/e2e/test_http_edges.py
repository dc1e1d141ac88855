"""The head's leftover edges (issue 24, item 7), over a fake backend: echoed values are cut, the
head's state is owner-only, whitespace-only chat text and sub-frame video lengths are refused, url
links do not follow a client's Host header, and connections that never finish their headers are
closed. Each fails on the head before its change."""

from __future__ import annotations

import os
import stat

import httpx
import pytest

from tests.e2e.http_support import FakeBackend, FakeFamily, serve, wait_for
from triptych.core.errors import InvalidParam
from triptych.head.app import HeadConfig, create_app

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


# ---- the head's state is owner-only ------------------------------------------------------------
def test_the_heads_state_is_owner_only(tmp_path):
    """Directories 0700, files 0600 (the jobs database and its WAL, url files, MP4s), under the
    usual umask 022 that gave 0755/0644 before."""
    old = os.umask(0o022)
    try:
        backends = {
            "img": FakeBackend(FakeFamily(tmp_path / "img")),
            "vid": FakeBackend(FakeFamily(tmp_path / "vid", is_video=True)),
        }
        data = tmp_path / "data"
        with serve(create_app(backends, HeadConfig(data_dir=data))) as base:
            image = httpx.post(f"{base}/v1/images/generations", json={"prompt": "x", "response_format": "url"})
            assert image.status_code == 200, image.text
            video = httpx.post(f"{base}/v1/videos", json={"prompt": "x"}).json()
            wait_for(lambda: httpx.get(f"{base}/v1/videos/{video['id']}").json()["status"] == "completed", "video")
            dirs = [data, data / "files", data / "videos"]
            files = [data / "jobs.sqlite", *(data / "files").iterdir(), *(data / "videos").iterdir()]
            files += [p for p in data.glob("jobs.sqlite-*")]
            modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in dirs + files}
    finally:
        os.umask(old)
    assert any(p.suffix == ".mp4" for p in files) and any(p.suffix == ".png" for p in files), modes
    assert any(p.name == "jobs.sqlite-wal" for p in files), modes
    assert {p.name: modes[p.name] for p in dirs} == {p.name: 0o700 for p in dirs}
    assert {p.name: modes[p.name] for p in files} == {p.name: 0o600 for p in files}


def test_a_data_dir_made_with_wider_modes_is_narrowed(tmp_path):
    data = tmp_path / "data"
    (data / "videos").mkdir(parents=True, mode=0o755)
    (data / "jobs.sqlite").touch(mode=0o644)
    os.chmod(data, 0o755)
    _, server = video_server(tmp_path)
    with server:
        pass
    assert stat.S_IMODE(data.stat().st_mode) == 0o700
    assert stat.S_IMODE((data / "videos").stat().st_mode) == 0o700
    assert stat.S_IMODE((data / "jobs.sqlite").stat().st_mode) == 0o600


# ---- whitespace-only chat text -----------------------------------------------------------------
class ChattingBackend(FakeBackend):
    """Answers every chat with "ok"."""

    async def chat(self, job, on_text=None):
        from triptych.chat import ChatResult

        return ChatResult("ok", 1, 1, "stop")


@pytest.mark.parametrize(
    "content",
    ["   \n\t ", "", [{"type": "text", "text": "  "}], [{"type": "text", "text": " "}, {"type": "text", "text": "\n"}]],
)
def test_a_whitespace_only_chat_message_is_400_naming_it(tmp_path, content):
    family = FakeFamily(tmp_path / "model")
    family.supports_chat = True
    _, server = make_server(tmp_path, ChattingBackend(family))
    messages = [{"role": "user", "content": "what is this?"}, {"role": "user", "content": content}]
    with server as base:
        refused = httpx.post(f"{base}/v1/chat/completions", json={"messages": messages})
        answered = httpx.post(f"{base}/v1/chat/completions", json={"messages": messages[:1]})
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["param"] == "messages[1].content" and "non-whitespace" in error["message"], error
    assert answered.status_code == 200 and answered.json()["choices"][0]["message"]["content"] == "ok"


# ---- a video shorter than one frame ------------------------------------------------------------
@pytest.mark.parametrize("seconds", [1e-300, 0.05])
def test_seconds_shorter_than_one_frame_is_400_naming_the_limit(tmp_path, seconds):
    backend, server = video_server(tmp_path)  # 16 fps: one frame is 0.0625 s
    with server as base:
        resp = httpx.post(f"{base}/v1/videos", json={"prompt": "x", "seconds": seconds})
        one_frame = httpx.post(f"{base}/v1/videos", json={"prompt": "x", "seconds": 0.0625})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == "seconds" and repr(seconds) in error["message"], error
    assert "at least 0.0625 (one frame at 16 fps)" in error["message"], error
    assert one_frame.status_code == 200 and one_frame.json()["frames"] == 1, one_frame.text
    assert [j.params.frames for j in backend.jobs] in ([], [1])  # the refused one reached no backend


# ---- url links do not follow a client's Host header --------------------------------------------
def url_for(base: str, host: str | None) -> str:
    headers = {"Host": host} if host else {}
    resp = httpx.post(f"{base}/v1/images/generations", json={"prompt": "x", "response_format": "url"}, headers=headers)
    assert resp.status_code == 200, resp.text
    return resp.json()["data"][0]["url"]


def test_a_url_link_ignores_a_host_header_not_allowed(tmp_path):
    _, server = make_server(tmp_path)
    with server as base:
        link = url_for(base, "evil.example")
        fetched = httpx.get(link)
    assert link.startswith(f"{base}/v1/files/file-"), link
    assert fetched.status_code == 200 and fetched.headers["content-type"] == "image/png"


def test_an_allowed_host_is_used_and_the_public_base_url_wins(tmp_path):
    _, server = make_server(tmp_path, allowed_hosts=("Gen.Example.com", "other.example:8443"))
    with server as base:
        named = url_for(base, "gen.example.com:9000")
        pinned = url_for(base, "other.example:8443")
        wrong_port = url_for(base, "other.example:9000")
    assert named.startswith("http://gen.example.com:9000/v1/files/"), named
    assert pinned.startswith("http://other.example:8443/v1/files/"), pinned
    assert wrong_port.startswith(f"{base}/v1/files/"), wrong_port
    _, server = make_server(
        tmp_path / "public", public_base_url="https://gen.example.com/", allowed_hosts=("x.example",)
    )
    with server as base:
        assert url_for(base, "x.example").startswith("https://gen.example.com/v1/files/")


def test_allowed_hosts_are_host_names():
    with pytest.raises(ValueError, match="allowed_hosts"):
        HeadConfig(data_dir="d", allowed_hosts=("http://gen.example.com/",))
