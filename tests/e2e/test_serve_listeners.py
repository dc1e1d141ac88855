"""A ``triptych serve --host 127.0.0.1`` process tree listens on loopback only, checked from the
processes' own sockets: every listening TCP socket held by the head or any of its workers (their
file descriptors, matched to ``/proc/net/tcp{,6}`` by inode) has a loopback local address.

The server runs as a real subprocess in its own process group (1 encoder, 1 denoiser, 1 decoder of
a tiny FLUX model, ``--transfer auto``, which is ZMQ on a loopback host because Mooncake's engine
listens on every interface), and the group is ended by its pgid.
"""

from __future__ import annotations

import ipaddress
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

LISTEN = "0A"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _descendants(root: int) -> set[int]:
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    tree, grew = {root}, True
    while grew:
        new = {pid for pid, parent in parents.items() if parent in tree} - tree
        tree |= new
        grew = bool(new)
    return tree


def _socket_inodes(pid: int) -> set[str]:
    out = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return out
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            out.add(target[8:-1])
    return out


def _address(hex_addr: str) -> ipaddress._BaseAddress:
    raw = bytes.fromhex(hex_addr)
    if len(raw) == 4:
        return ipaddress.IPv4Address(raw[::-1])
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))  # /proc/net/tcp6: 4 little-endian words
    return ipaddress.IPv6Address(words)


def _listeners(pids: set[int]) -> list[tuple[int, str, int]]:
    """(pid, local address, port) of every listening TCP socket the processes hold."""
    owner = {inode: pid for pid in pids for inode in _socket_inodes(pid)}
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == LISTEN and inode in owner:
                addr, port = local.split(":")
                found.append((owner[inode], str(_address(addr)), int(port, 16)))
    return found


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    port = _free_port()
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
    pids = _descendants(proc.pid)
    assert len(pids) >= 4, f"expected the head and 3 workers, found pids {pids}"
    listeners = _listeners(pids)
    assert any(p == port for _, _, p in listeners), f"the HTTP port {port} is not among {listeners}"
    assert len({pid for pid, _, _ in listeners}) >= 2, f"only one process listens: {listeners}"
    outside = [entry for entry in listeners if not ipaddress.ip_address(entry[1]).is_loopback]
    assert not outside, f"listeners on a non-loopback address: {outside}"
