"""A ``triptych serve --host 127.0.0.1`` process tree listens on loopback only, checked from the
processes' own sockets: every listening TCP socket held by the head or any of its workers (each
process's TCP connections, as ``psutil`` reads them) has a loopback local address.

The server runs as a real subprocess in its own process group (1 encoder, 1 denoiser, 1 decoder of
a tiny FLUX model, ``--transfer auto``, which is ZMQ on a loopback host because Mooncake's engine
listens on every interface), and the group is ended by its pgid.
"""

from __future__ import annotations

import ipaddress
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from tests.e2e.http_support import free_port
from tests.procs import descendants
from tests.procs import listeners as tcp_listeners


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    port = free_port()
    cmd = [sys.executable, "-m", "triptych.cli", "serve", "--model", str(tiny_model_dir("flux")), "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--data-dir", str(tmp_path_factory.mktemp("listeners"))]
    log = tmp_path_factory.mktemp("listeners-log") / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"serve exited {proc.returncode}: {log.read_text()[-2000:]}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"serve not healthy within 240 s: {log.read_text()[-2000:]}")
            time.sleep(0.5)
        yield proc, port
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_every_listener_of_the_server_tree_is_on_loopback(server):
    proc, port = server
    pids = descendants(proc.pid)
    assert len(pids) >= 4, f"expected the head and 3 workers, found pids {pids}"
    listeners = tcp_listeners(pids)
    assert any(p == port for _, _, p in listeners), f"the HTTP port {port} is not among {listeners}"
    assert len({pid for pid, _, _ in listeners}) >= 2, f"only one process listens: {listeners}"
    outside = [entry for entry in listeners if not ipaddress.ip_address(entry[1]).is_loopback]
    assert not outside, f"listeners on a non-loopback address: {outside}"
