"""Helpers of the Ray tests: which sockets the Ray processes listen on."""

from __future__ import annotations

import ipaddress
import os

import psutil


def listeners(pids: list[int] | None = None) -> list[tuple[int, str, str, int]]:
    """(pid, process name, address, port) of every listening TCP socket and bound UDP socket held by
    this process and its descendants (a Ray cluster started from here), or by ``pids``."""
    if pids is None:
        me = psutil.Process(os.getpid())
        procs = [me, *me.children(recursive=True)]
    else:
        procs = [psutil.Process(p) for p in pids]
    out = []
    for proc in procs:
        try:
            conns, name = proc.net_connections(kind="inet"), proc.name()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        for c in conns:
            if c.laddr and (c.status == psutil.CONN_LISTEN or (c.status == psutil.CONN_NONE and not c.raddr)):
                out.append((proc.pid, name, c.laddr.ip, c.laddr.port))
    return out


def is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address.split("%")[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback
