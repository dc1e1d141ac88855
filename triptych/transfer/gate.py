"""The receiver's door: a request frame is read only once its header proves the slot's capability.

``Gate.open`` takes the frames a ROUTER delivered (``[header, mac, *payload]``) and returns the
decoded request when ``mac`` verifies under the capability of the slot the header names
(``capability``), or the Ack refusing it. A refusal is counted (``TransferStats.unauthenticated``)
and says nothing of what the endpoint holds: the same ``REFUSED`` reason whatever was wrong, no
transfer id echoed. Oversized frames never get here: the socket drops them (``zmq.MAXMSGSIZE``).
"""

from __future__ import annotations

import logging

import msgspec
import zmq

from triptych.core.errors import shown
from triptych.transfer.capability import TransferKey
from triptych.transfer.messages import MAX_HEADER_BYTES, REQUEST_DECODER, Ack, FetchRequest, Request
from triptych.transfer.stats import TransferStats

logger = logging.getLogger(__name__)

#: The one reason a peer without a valid capability is given.
REFUSED = "refused"


class Gate:
    """Authenticates request frames for the endpoint of instance ``receiver``; used by its serving
    thread only."""

    def __init__(self, key: TransferKey, receiver: str, stats: TransferStats) -> None:
        self.key = key
        self.receiver = receiver
        self.stats = stats
        self._refused = 0

    def capability(self, msg: Request) -> bytes:
        """The capability ``msg`` must be sealed with: its slot's on this receiver, or for a
        ``FetchRequest`` the asker's slot it names (the asker is that slot's receiver)."""
        if isinstance(msg, FetchRequest):
            ref = msg.ref
            return self.key.capability(ref.transfer_id, ref.request, ref.owner, ref.slot)
        return self.key.capability(msg.transfer_id, msg.request, self.receiver, msg.slot)

    def open(self, frames: list[zmq.Frame]) -> Request | Ack:
        """The authentic request of ``frames``, or the (counted) Ack refusing them."""
        if len(frames) < 2 or len(frames[0].buffer) > MAX_HEADER_BYTES:
            return self.refuse(None, "no header and mac")
        try:
            msg = REQUEST_DECODER.decode(frames[0].buffer)
        except msgspec.DecodeError:
            return self.refuse(None, "an unreadable header")
        if not self.key.verify(self.capability(msg), frames[0].bytes, frames[1].bytes):
            return self.refuse(msg, "no valid capability")
        return msg

    def refuse(self, msg: Request | None, why: str) -> Ack:
        """Count and log (the first, then every 1000th, escaped and cut) a refused request."""
        self.stats.add(rejected_pushes=1, unauthenticated=1)
        self._refused += 1
        if self._refused == 1 or self._refused % 1000 == 0:
            what = "a request" if msg is None else f"{type(msg).__name__} {shown(msg.transfer_id)}"
            sender = "" if msg is None else f" from {shown(msg.sender)}"
            logger.warning("%s refused %s%s: %s (%d so far)", self.receiver, what, sender, why, self._refused)
        return Ack(-1 if msg is None else msg.seq, "", False, REFUSED)
