"""The head's input edges (issue 14's reproductions), over a fake backend: bounded JSON bodies, the
media types a POST may have, slow clients, bodies that are not objects, non-ASCII digits, and the
API key's tenant reaching the request. Each fails on the head before this change."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest

from tests.e2e.http_support import FakeBackend, FakeFamily, serve
from tests.procs import rss_bytes
from triptych.head.app import HeadConfig, create_app

MB = 1 << 20


def make_server(tmp_path, **config):
    backend = FakeBackend(FakeFamily(tmp_path / "model"))
    return backend, serve(create_app(backend, HeadConfig(data_dir=tmp_path / "data", **config)))


def raw(base: str, request: bytes, then: bytes = b"", wait_s: float = 30.0) -> bytes:
    """Send ``request`` (and ``then``) on a plain socket; return what came back before the close."""
    host, port = base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=wait_s) as s:
        s.sendall(request)
        if then:
            try:
                s.sendall(then)
            except OSError:  # the head answered and closed before reading it all
                pass
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


def test_a_declared_256_mib_json_body_is_refused_before_it_is_read(tmp_path):
    _, server = make_server(tmp_path)
    with server as base:
        head = b"POST /v1/images/generations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        # Only the headers are sent: a head that waited for the body would time this out (30 s). (Bytes
        # of body sent beside them stay unread by a head that refuses, and its close then resets the
        # connection, which can discard the 413 before this client reads it: seen once in CI.)
        answer = raw(base, head + f"Content-Length: {256 * MB}\r\n\r\n".encode())
    assert answer.startswith(b"HTTP/1.1 413") and b"max_json_bytes" in answer


def test_an_undeclared_huge_body_stops_at_the_limit_without_the_head_holding_it(tmp_path):
    """Chunked (no Content-Length): the head stops reading at the limit; the process's RSS (head and
    this client together, the client streams from a small buffer) grows by less than 2× the limit."""
    limit = 8 * MB
    _, server = make_server(tmp_path, max_json_bytes=limit)
    with server as base:
        before = rss_bytes()
        chunk = b" " * MB

        def body():
            yield b'{"prompt": "'
            for _ in range(256):
                yield chunk

        try:
            resp = httpx.post(
                f"{base}/v1/images/generations", content=body(), headers={"content-type": "application/json"}
            )
            status = resp.status_code
        except httpx.HTTPError:  # the head closed mid-upload after answering; it answered 413 (below)
            status = 413
        grown = rss_bytes() - before
    assert status == 413
    assert grown < 2 * limit, f"RSS grew by {grown / MB:.0f} MiB for a {limit / MB:.0f} MiB limit"


@pytest.mark.parametrize("path", ["/v1/videos", "/v1/images/generations", "/v1/chat/completions"])
def test_a_text_plain_post_is_refused_415(tmp_path, path):
    """What any web page can send cross-site without a preflight: refused before any parsing."""
    _, server = make_server(tmp_path)
    with server as base:
        resp = httpx.post(f"{base}{path}", content=b'{"prompt": "x"}', headers={"content-type": "text/plain"})
    assert resp.status_code == 415 and "text/plain" in resp.json()["error"]["message"]


def test_a_client_that_stops_sending_its_body_gets_408(tmp_path):
    _, server = make_server(tmp_path, body_read_timeout_s=1.0)
    with server as base:
        t0 = time.monotonic()
        head = b"POST /v1/images/generations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        answer = raw(base, head + b"Content-Length: 100\r\n\r\n", b'{"prompt": ', wait_s=20)
        waited = time.monotonic() - t0
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert waited < 15  # the 1 s read timeout, not the client's patience


def test_a_body_that_is_not_an_object_is_named_as_such(tmp_path):
    _, server = make_server(tmp_path)
    with server as base:
        resp = httpx.post(f"{base}/v1/images/generations", json=[1, 2])
    message = resp.json()["error"]["message"]
    assert resp.status_code == 400 and "must be a JSON object" in message and "None=" not in message


def test_an_empty_body_is_named_as_missing_not_as_field_none(tmp_path):
    _, server = make_server(tmp_path)
    with server as base:
        resp = httpx.post(f"{base}/v1/images/generations", content=b"", headers={"content-type": "application/json"})
    message = resp.json()["error"]["message"]
    assert resp.status_code == 400 and "missing request body" in message and "None" not in message, message


def test_include_usage_must_be_a_boolean(tmp_path):
    _, server = make_server(tmp_path)
    body = {"messages": [{"role": "user", "content": "hi"}], "stream": True, "stream_options": {"include_usage": "yes"}}
    with server as base:
        resp = httpx.post(f"{base}/v1/chat/completions", json=body)
    error = resp.json()["error"]
    assert resp.status_code == 400 and error["param"] == "stream_options.include_usage", error
    assert "'yes'" in error["message"] and "bool" in error["message"], error["message"]


def test_sizes_take_ascii_digits_only(tmp_path):
    _, server = make_server(tmp_path)
    with server as base:
        resp = httpx.post(f"{base}/v1/images/generations", json={"prompt": "x", "size": "６４x６４"})
        ok = httpx.post(f"{base}/v1/images/generations", json={"prompt": "x", "size": "64x64"})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "size"
    assert ok.status_code == 200


def test_the_api_keys_tenant_reaches_the_request_as_a_hash(tmp_path):
    backend, server = make_server(tmp_path, api_keys=("key-of-tenant-a", "key-of-tenant-b"))
    with server as base:
        for key in ("key-of-tenant-a", "key-of-tenant-b", "key-of-tenant-a"):
            r = httpx.post(
                f"{base}/v1/images/generations",
                json={"prompt": "x", "seed": 1},
                headers={"authorization": f"Bearer {key}"},
            )
            assert r.status_code == 200
    a1, b, a2 = (job.params.tenant for job in backend.jobs)
    assert a1 == a2 != b and a1.startswith("key-") and "tenant-a" not in a1


def test_without_keys_every_request_shares_the_empty_tenant(tmp_path):
    backend, server = make_server(tmp_path)
    with server as base:
        assert httpx.post(f"{base}/v1/images/generations", json={"prompt": "x"}).status_code == 200
    assert backend.jobs[0].params.tenant == ""


def test_concurrent_tenants_do_not_leak_into_each_other(tmp_path):
    """The tenant lives in the request's context, not in a shared variable."""
    backend, server = make_server(tmp_path, api_keys=tuple(f"key-number-{i:02d}" for i in range(8)))
    with server as base:

        def post(i):
            httpx.post(
                f"{base}/v1/images/generations",
                json={"prompt": f"p{i}", "seed": i},
                headers={"authorization": f"Bearer key-number-{i:02d}"},
            )

        threads = [threading.Thread(target=post, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    by_prompt = {job.params.prompt: job.params.tenant for job in backend.jobs}
    assert len(by_prompt) == 8 and len(set(by_prompt.values())) == 8


def _pool(live: int, configured: int) -> dict:
    """A describe() of a head with ``configured`` local denoisers (all running), ``live`` registered."""
    workers = {f"denoiser-{i}": {"role": "denoiser", "running": True} for i in range(configured)}
    instances = [{"id": f"denoiser-{i}", "role": "denoiser", "state": "idle"} for i in range(live)]
    return {"empty_roles": [] if live else ["denoiser"], "instances": instances, "local_workers": {"workers": workers}}


@pytest.mark.parametrize(
    "describe,status,code",
    [
        ({}, "ok", 200),
        ({"empty_roles": [], "local_workers": {"workers": {"denoiser-0": {"running": False}}}}, "degraded", 200),
        ({"empty_roles": ["denoiser"]}, "unavailable", 503),
        (_pool(2, 2), "ok", 200),
        (_pool(1, 2), "degraded", 200),  # a replacement restarted (running) but not yet registered
        (_pool(0, 2), "unavailable", 503),
    ],
)
def test_health_says_degraded_or_unavailable_and_the_status_code_follows(tmp_path, describe, status, code):
    """Issue 24 item 5: a role below its configured pool is ``degraded`` and named with its counts."""
    backend, server = make_server(tmp_path)
    backend.describe = lambda: describe
    with server as base:
        r = httpx.get(f"{base}/health")
    assert (r.status_code, r.json()["status"]) == (code, status)
    if "instances" in describe:
        live = len(describe["instances"])
        assert r.json()["roles"] == {"denoiser": {"live": live, "configured": 2}}
