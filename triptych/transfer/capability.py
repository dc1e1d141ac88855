"""Capabilities of the transfer plane: who may fill a reserved slot, or ask a lender to push into one.

A slot's capability is an HMAC-SHA256, under a key derived from the deployment's token, over
(transfer id, request id, receiving instance, slot index); both ends compute it from the slot's
``TensorRef`` and the token, so the capability itself never travels. Every request frame a sender
puts on the transfer plane is ``[header, mac, *payload]`` where ``mac`` is an HMAC of the header under
the capability of the slot it is about: a peer without the token cannot make one, and one made for
another slot, another request or another receiver does not verify. The MAC covers the header (the
transfer id, sender, sequence number, dtype, shape and byte count), not the payload bytes; a replay of
an authentic header is refused by the slot's state (filled once, ids never reused).
"""

from __future__ import annotations

import hashlib
import hmac

import msgspec

_CONTEXT = b"triptych transfer plane v1\0"
MAC_BYTES = 32
_ENCODER = msgspec.msgpack.Encoder()


class TransferKey:
    """The deployment token's transfer-plane key (a different key from the control plane's)."""

    def __init__(self, token: str) -> None:
        if len(token) < 16:
            raise ValueError("the transfer-plane token must be at least 16 characters (the deployment token)")
        self._key = hashlib.sha256(_CONTEXT + token.encode()).digest()

    def capability(self, transfer_id: str, request: str, receiver: str, slot: int) -> bytes:
        """The capability of one reserved slot."""
        data = _ENCODER.encode((transfer_id, request, receiver, slot))
        return hmac.new(self._key, data, hashlib.sha256).digest()

    def seal(self, capability: bytes, header: bytes) -> bytes:
        """The MAC a request frame carries beside its ``header``."""
        return hmac.new(capability, header, hashlib.sha256).digest()

    def verify(self, capability: bytes, header: bytes, mac: bytes) -> bool:
        return len(mac) == MAC_BYTES and hmac.compare_digest(self.seal(capability, header), mac)
