"""The head's control socket bounds what a peer without the token can make it hold or write: a frame
above the socket's limit is dropped before it is read (and the socket keeps serving), and a tokenless
``Hello``'s id is logged and echoed cut and escaped (issue 47: an 8 MiB id added 8 MiB to the log;
one with a newline wrote a forged log line)."""

from __future__ import annotations

import asyncio
import logging

import zmq
import zmq.asyncio

from triptych.control import listener
from triptych.control import protocol as P
from triptych.control.auth import NO_SESSION, ControlKey
from triptych.control.counters import ControlCounters
from triptych.control.listener import ControlPlane

FORGED = "\nCRITICAL triptych.head: forged"


async def _exchange(plane: ControlPlane, frames: list[bytes], wait_s: float = 5.0) -> list[bytes] | None:
    """Send ``frames`` from a fresh DEALER; the reply, or None when none came in ``wait_s``."""
    ctx = zmq.asyncio.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(plane.address)
    try:
        await sock.send_multipart(frames)
        if await sock.poll(wait_s * 1000, zmq.POLLIN):
            return await sock.recv_multipart()
        return None
    finally:
        sock.close(linger=0)


def _tokenless_hello(instance_id: str) -> list[bytes]:
    """A Hello sealed with another token: the head refuses it unsigned."""
    return ControlKey("x" * 16).seal_sequenced(NO_SESSION, 1, P.encode(P.Hello(instance_id=instance_id)))


def _run(coro_fn, **plane_kw):
    async def main():
        counters = ControlCounters()
        plane = ControlPlane("127.0.0.1", 0, ControlKey("t" * 16), counters, on_message=lambda *_: None)
        plane.start()
        try:
            return await coro_fn(plane, counters)
        finally:
            await plane.close()

    return asyncio.run(main())


def test_the_control_socket_sets_a_frame_limit_and_drops_a_larger_frame_but_keeps_serving(monkeypatch):
    monkeypatch.setattr(listener, "MAX_FRAME_BYTES", 64 << 10)

    async def scenario(plane, counters):
        limit = plane._sock.getsockopt(zmq.MAXMSGSIZE)
        big = await _exchange(plane, [b"\0" * 16, b"x" * (1 << 20), b"m" * 32], wait_s=1.0)
        seen_after_big = counters.unauthenticated + counters.malformed
        small = await _exchange(plane, _tokenless_hello("w-1"))
        return limit, big, seen_after_big, small

    limit, big, seen_after_big, small = _run(scenario)
    assert limit == 64 << 10
    assert big is None and seen_after_big == 0  # dropped by ZMQ: never reached the head's code
    assert small is not None and P.decode_any(small[0]).accepted is False  # still serving


def test_a_tokenless_hellos_huge_newline_id_is_logged_short_and_escaped(caplog):
    instance_id = FORGED + "x" * (1 << 20)

    async def scenario(plane, counters):
        return await _exchange(plane, _tokenless_hello(instance_id)), counters.unauthenticated

    with caplog.at_level(logging.WARNING, logger="triptych.control.listener"):
        reply, unauthenticated = _run(scenario)
    lines = [r.getMessage() for r in caplog.records if r.name == "triptych.control.listener"]
    assert unauthenticated == 1 and len(lines) == 1, lines
    line = lines[0]
    assert "\n" not in line and len(line) < 400, line[:500]
    assert "\\nCRITICAL" in line  # the newline is shown escaped, not written
    refusal = P.decode_any(reply[0])
    assert refusal.accepted is False and len(refusal.instance_id) <= 256
