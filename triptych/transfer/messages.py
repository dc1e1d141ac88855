"""Wire messages between a sender and a receiver endpoint (msgpack via msgspec; never pickle).

Frames on the receiver's ROUTER socket: [sender identity, header, mac, *payload]; the reply is
[identity, Ack]. ``mac`` seals the header under the capability of the slot it names
(``capability``); a request whose mac does not verify is refused unread. Only `DataPush` carries a
payload frame (the raw tensor bytes). `FetchRequest` turns
the roles round: the asker reserved a slot of its own and asks this endpoint to push a tensor it
lends (``lending``) into it.
"""

from __future__ import annotations

import msgspec

from triptych.transfer.refs import TensorRef


class DataPush(msgspec.Struct, frozen=True, tag="push"):
    """The tensor bytes follow in the next frame (ZMQ data path)."""

    seq: int  # sender-side sequence number, echoed in the Ack
    transfer_id: str  # reservation being filled
    sender: str  # sender instance id; must equal the reservation's peer
    dtype: str  # wire dtype name
    shape: tuple[int, ...]
    nbytes: int  # length of the payload frame
    request: str  # the request the slot was reserved for (``TensorRef.request``)
    slot: int  # the slot's index (``TensorRef.slot``)


class WriteClaim(msgspec.Struct, frozen=True, tag="claim"):
    """Sender announces it is about to write the slot remotely (Mooncake data path)."""

    seq: int
    transfer_id: str
    sender: str
    nbytes: int
    request: str
    slot: int


class WriteDone(msgspec.Struct, frozen=True, tag="done"):
    """Sender finished (or failed) its remote write; on success the slot becomes READY."""

    seq: int
    transfer_id: str
    sender: str
    nbytes: int
    failed: bool  # True: the write failed; the receiver fails the transfer and frees the slot
    request: str
    slot: int


class FetchRequest(msgspec.Struct, frozen=True, tag="fetch"):
    """The sender reserved ``ref`` on its own endpoint and asks this one to push into it the tensor it
    lends under ``key`` (ack: the push is under way; refused: it lends nothing of that key and shape)."""

    seq: int
    transfer_id: str  # = ref.transfer_id
    sender: str  # the asker's instance id (the slot's owner)
    nbytes: int  # = ref.nbytes
    key: str  # what the lender lends it under (an mm-hash)
    ref: TensorRef  # the asker's reserved slot, reserved for this endpoint's instance as its peer


class Ack(msgspec.Struct, frozen=True, tag="ack"):
    """Receiver's reply to every request."""

    seq: int  # echo of the request's seq
    transfer_id: str
    ok: bool
    reason: str  # why it was rejected; empty when ok


Request = DataPush | WriteClaim | WriteDone | FetchRequest

#: Longest header frame a receiver decodes (a header is a few hundred bytes; ids are bounded by it).
MAX_HEADER_BYTES = 64 << 10
#: Longest frame a sender accepts back (an Ack).
MAX_ACK_BYTES = 64 << 10

ENCODER = msgspec.msgpack.Encoder()
REQUEST_DECODER = msgspec.msgpack.Decoder(Request)
ACK_DECODER = msgspec.msgpack.Decoder(Ack)
