"""Connections that never finish their request head are closed after ``header_timeout_s`` (issue 24,
7b: 50 of 50 such connections were still open after 35 s). The head runs under the uvicorn config
``serve`` uses (``http_server.uvicorn_config``); a closed socket is seen as EOF, waited for with a
deadline, not timed."""

from __future__ import annotations

import contextlib
import socket
import threading

import httpx
import uvicorn

from tests.e2e.http_support import FakeBackend, FakeFamily, wait_for
from triptych.head.app import HeadConfig, create_app
from triptych.head.serve import uvicorn_config

TIMEOUT_S = 0.5
DEADLINE_S = 60.0  # liveness bound on seeing EOF; a head without the timeout never closes them


@contextlib.contextmanager
def serve_like_serve(tmp_path, backend=None, **config):
    """``create_app`` under ``uvicorn_config`` on a free loopback port; yields (backend, base URL)."""
    backend = backend or FakeBackend(FakeFamily(tmp_path / "model"))
    head_config = HeadConfig(data_dir=tmp_path / "data", header_timeout_s=TIMEOUT_S, **config)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn_config(create_app(backend, head_config), head_config, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    wait_for(lambda: server.started or not thread.is_alive(), "server start")
    assert server.started
    try:
        yield backend, f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def connect(base: str) -> socket.socket:
    host, port = base.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=DEADLINE_S)


def read_until_eof(s: socket.socket) -> bytes:
    """What the head sends until it closes the socket (socket.timeout past the deadline)."""
    out = b""
    while chunk := s.recv(65536):
        out += chunk
    return out


PARTIAL = [b"", b"GET /hea", b"GET /health HTTP/1.1\r\n", b"GET /health HTTP/1.1\r\nHost: x\r\nAccept: */*\r\n"]


def test_connections_that_never_finish_their_headers_are_closed(tmp_path):
    with serve_like_serve(tmp_path) as (_, base):
        sockets = [connect(base) for _ in range(3) for _ in PARTIAL]
        try:
            for i, s in enumerate(sockets):
                if PARTIAL[i % len(PARTIAL)]:
                    s.sendall(PARTIAL[i % len(PARTIAL)])
            answers = [read_until_eof(s) for s in sockets]  # raises socket.timeout if one stays open
        finally:
            for s in sockets:
                s.close()
        assert answers == [b""] * len(sockets)  # closed without a response: there was no request
        assert httpx.get(f"{base}/health").status_code == 200  # the head still serves


def test_a_partial_second_request_on_a_keep_alive_connection_is_closed(tmp_path):
    with serve_like_serve(tmp_path) as (_, base), connect(base) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        first = b""
        while b'"status"' not in first or not first.rstrip().endswith(b"}"):
            first += s.recv(65536)
        assert first.startswith(b"HTTP/1.1 200")
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # and never the blank line
        assert read_until_eof(s) == b""


def test_a_request_whose_headers_arrived_is_not_cut_by_the_header_timeout(tmp_path):
    """A gated job outlives the header timeout (a partial connection opened after it started was
    closed meanwhile), then is answered."""
    backend = FakeBackend(FakeFamily(tmp_path / "model"), gated=True)
    with serve_like_serve(tmp_path, backend) as (_, base):
        result = {}

        def post():
            result["resp"] = httpx.post(f"{base}/v1/images/generations", json={"prompt": "x"}, timeout=DEADLINE_S)

        thread = threading.Thread(target=post)
        thread.start()
        wait_for(lambda: backend.running, "the job to start")
        with connect(base) as s:
            s.sendall(b"GET /health HTTP/1.1\r\n")
            assert read_until_eof(s) == b""  # header_timeout_s has passed since the job started
        backend.open_gate()
        thread.join(DEADLINE_S)
    assert result["resp"].status_code == 200, result["resp"].text


def test_header_timeout_is_positive():
    import pytest

    with pytest.raises(ValueError, match="header_timeout_s"):
        HeadConfig(data_dir="d", header_timeout_s=0)
