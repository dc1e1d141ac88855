"""The head's control socket shares its event loop: a steady flow of frames must not hold it."""

from __future__ import annotations

import asyncio

from triptych.control.auth import ControlKey
from triptych.control.counters import ControlCounters
from triptych.control.listener import ControlPlane


class QueuedFrames:
    """A socket with ``n`` frames queued: like ``zmq.asyncio``, each receive is a future that is
    done already (awaiting it does not suspend); after the last, one that never completes."""

    def __init__(self, n: int):
        self.left = n

    def recv_multipart(self) -> asyncio.Future:
        future = asyncio.get_running_loop().create_future()
        if self.left:
            self.left -= 1
            future.set_result([b"worker", b"frame"])
        return future


def test_a_flood_of_frames_leaves_the_loop_turns_for_the_http_side():
    """Before: 2,000 queued frames were all handled before anything else on the loop ran (a streamed
    chat's pieces held the head's loop for 2.9 s, so a client that left was noticed late)."""
    handled = []

    async def main():
        plane = ControlPlane("127.0.0.1", 0, ControlKey("t" * 16), ControlCounters(), on_message=lambda *_: None)
        plane._sock = QueuedFrames(2000)
        plane.receive = handled.append
        seen_at = []
        loop_task = asyncio.create_task(plane._recv_loop())
        for _ in range(3):  # another coroutine's turns while the frames are read
            await asyncio.sleep(0)
            seen_at.append(len(handled))
        loop_task.cancel()
        await asyncio.gather(loop_task, return_exceptions=True)
        return seen_at

    seen_at = asyncio.run(main())
    assert seen_at[0] < 10 and seen_at[0] < seen_at[1] < seen_at[2] < 2000, seen_at
