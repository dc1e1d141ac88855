"""Sender side of the control/data socket: one DEALER per receiver address."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

import msgspec
import zmq

from triptych.core.errors import shown
from triptych.transfer.errors import TransferTimeout
from triptych.transfer.messages import ACK_DECODER, ENCODER, MAX_ACK_BYTES, Ack, Request

logger = logging.getLogger(__name__)


class PeerChannel:
    """A DEALER socket to one receiver; one request in flight at a time (lock-serialized)."""

    def __init__(self, ctx: zmq.Context, address: str) -> None:
        self.address = address
        self.lock = threading.Lock()
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_ACK_BYTES)
        self.sock.connect(address)

    def request(self, msg: Request, seal: Callable[[bytes], bytes], payload: Sequence[object], timeout_s: float) -> Ack:
        """Send ``[header, seal(header), *payload]`` and wait for its Ack (``seal``: the slot's MAC)."""
        header = ENCODER.encode(msg)
        with self.lock:
            # NOTE: copy=False keeps a reference to the tensor memory until ZMQ sent it; the caller
            # keeps the tensor alive and unmodified until the Ack, which implies it was sent.
            self.sock.send_multipart([header, seal(header), *payload], copy=False)
            end = time.monotonic() + timeout_s
            while (remaining := end - time.monotonic()) > 0:
                if not self.sock.poll(remaining * 1000, zmq.POLLIN):
                    break
                try:
                    ack = ACK_DECODER.decode(self.sock.recv())
                except msgspec.DecodeError:
                    logger.debug("dropping an unreadable ack from %s", self.address)
                    continue
                if ack.seq == msg.seq:
                    return ack
                logger.debug("dropping stale ack seq=%d from %s", ack.seq, self.address)
        raise TransferTimeout(f"no ack for {shown(msg.transfer_id)} from {self.address} in {timeout_s}s")

    def close(self) -> None:
        with self.lock:
            self.sock.close(linger=0)
