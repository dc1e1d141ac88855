"""The two names every layer shares: a worker's ``Role`` (the pool it serves) and the tensor
``TransferKind`` (the peer-to-peer backend). ``StrEnum``s: each member is its own string on the wire
(msgspec), as a metric label, a flag value and a dict key, so ``Role.ENCODER == "encoder"``; its
``repr`` is the string's too, so messages that show a role or a dict of roles read as before."""

from __future__ import annotations

from enum import StrEnum


class _Name(StrEnum):
    def __repr__(self) -> str:
        return str.__repr__(self.value)


class Role(_Name):
    """The pools an instance can serve; each loads only its components."""

    ENCODER = "encoder"
    DENOISER = "denoiser"
    DECODER = "decoder"


ROLES: tuple[Role, ...] = tuple(Role)  # in pipeline order: encoder, denoiser, decoder


class TransferKind(_Name):
    """The tensor transfer backend a worker asks for (``AUTO``) or runs (``MOONCAKE`` or ``ZMQ``)."""

    AUTO = "auto"
    """Mooncake where it imports, initializes and the host is not a loopback address; else ZMQ."""
    MOONCAKE = "mooncake"
    ZMQ = "zmq"
