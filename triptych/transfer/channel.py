"""Sender side of the control/data socket: one DEALER per receiver address."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

import zmq

from triptych.transfer.errors import TransferTimeout
from triptych.transfer.messages import ACK_DECODER, ENCODER, Ack, Request

logger = logging.getLogger(__name__)


class PeerChannel:
    """A DEALER socket to one receiver; one request in flight at a time (lock-serialized)."""

    def __init__(self, ctx: zmq.Context, address: str) -> None:
        self.address = address
        self.lock = threading.Lock()
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)

    def request(self, msg: Request, payload: Sequence[object], timeout_s: float) -> Ack:
        with self.lock:
            # NOTE: copy=False keeps a reference to the tensor memory until ZMQ sent it; the caller
            # keeps the tensor alive and unmodified until the Ack, which implies it was sent.
            self.sock.send_multipart([ENCODER.encode(msg), *payload], copy=False)
            end = time.monotonic() + timeout_s
            while (remaining := end - time.monotonic()) > 0:
                if not self.sock.poll(remaining * 1000, zmq.POLLIN):
                    break
                ack = ACK_DECODER.decode(self.sock.recv())
                if ack.seq == msg.seq:
                    return ack
                logger.debug("dropping stale ack seq=%d from %s", ack.seq, self.address)
        raise TransferTimeout(f"no ack for {msg.transfer_id!r} from {self.address} in {timeout_s}s")

    def close(self) -> None:
        with self.lock:
            self.sock.close(linger=0)
