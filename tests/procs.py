"""Process checks for the tests, through ``psutil`` (no hand parsing of ``/proc``).

A zombie has exited already (only its parent has not reaped it yet), so ``alive`` counts it gone.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import psutil


def alive(pid: int) -> bool:
    """The process runs (exists and is not a zombie)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_gone(pids: Iterable[int], timeout_s: float) -> list[int]:
    """Poll up to ``timeout_s`` (a liveness bound) until every process exited; returns those still
    running. Polled, not waited on: these are not our children, and ``psutil``'s wait for another's
    child waits for the pid to vanish, which a zombie its parent never reaps does not."""
    deadline = time.monotonic() + timeout_s
    running = [pid for pid in pids if alive(pid)]
    while running and time.monotonic() < deadline:
        time.sleep(0.05)
        running = [pid for pid in running if alive(pid)]
    return running


def children(pid: int) -> list[int]:
    """The running (not zombie) direct children of ``pid``."""
    try:
        kids = psutil.Process(pid).children()
    except psutil.NoSuchProcess:
        return []
    return [c.pid for c in kids if alive(c.pid)]


def descendants(pid: int) -> set[int]:
    """``pid`` and every process below it."""
    try:
        return {pid} | {c.pid for c in psutil.Process(pid).children(recursive=True)}
    except psutil.NoSuchProcess:
        return {pid}


def listeners(pids: Iterable[int]) -> list[tuple[int, str, int]]:
    """(pid, local address, port) of every listening TCP socket the processes hold."""
    found = []
    for pid in pids:
        try:
            conns = psutil.Process(pid).net_connections(kind="tcp")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        found += [(pid, c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN]
    return found


def rss_bytes(pid: int | None = None) -> int:
    """Resident memory of ``pid`` (None: this process)."""
    return psutil.Process(pid).memory_info().rss
