"""Wire messages between a sender and a receiver endpoint (msgpack via msgspec; never pickle).

Frames on the receiver's ROUTER socket: [sender identity, header, *payload]; the reply is
[identity, Ack]. Only `DataPush` carries a payload frame (the raw tensor bytes).
"""

from __future__ import annotations

import msgspec


class DataPush(msgspec.Struct, frozen=True, tag="push"):
    """The tensor bytes follow in the next frame (ZMQ data path)."""

    seq: int  # sender-side sequence number, echoed in the Ack
    transfer_id: str  # reservation being filled
    sender: str  # sender instance id; must equal the reservation's peer
    dtype: str  # wire dtype name
    shape: tuple[int, ...]
    nbytes: int  # length of the payload frame


class WriteClaim(msgspec.Struct, frozen=True, tag="claim"):
    """Sender announces it is about to write the slot remotely (Mooncake data path)."""

    seq: int
    transfer_id: str
    sender: str
    nbytes: int


class WriteDone(msgspec.Struct, frozen=True, tag="done"):
    """Sender finished (or failed) its remote write; on success the slot becomes READY."""

    seq: int
    transfer_id: str
    sender: str
    nbytes: int
    failed: bool  # True: the write failed; the receiver fails the transfer and frees the slot


class Ack(msgspec.Struct, frozen=True, tag="ack"):
    """Receiver's reply to every request."""

    seq: int  # echo of the request's seq
    transfer_id: str
    ok: bool
    reason: str  # why it was rejected; empty when ok


Request = DataPush | WriteClaim | WriteDone

ENCODER = msgspec.msgpack.Encoder()
REQUEST_DECODER = msgspec.msgpack.Decoder(Request)
ACK_DECODER = msgspec.msgpack.Decoder(Ack)
