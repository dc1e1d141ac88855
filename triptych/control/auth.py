"""Authenticated control frames: every control message carries an HMAC-SHA256 of its bytes under a key
derived from the deployment's token. Only holders of the token can register, and a frame that fails
the check is dropped (and counted) before it is decoded. ``serve`` makes a token for its local
workers; remote workers are given it (``--token`` or ``$TRIPTYCH_TOKEN``).

Frames on the wire, head → worker: ``[payload, mac]``. Worker → head: ``[header, payload, mac]``
(a ROUTER sees the sender's identity first), where the header is the worker's control session (the
16-byte challenge the head issued for its registration, zeros before it has one) and a 64-bit
sequence number that grows with every frame the socket sends; the MAC covers header and payload.
The head checks both (``sessions.SessionTable``): a frame of another session, from a socket the
session was not bound to, or not newer than the last one it accepted from that socket, is a replay
and is dropped. The MAC alone binds the bytes, not their freshness.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import struct
from pathlib import Path

logger = logging.getLogger(__name__)

_CONTEXT = b"triptych control plane v1\0"
SESSION_BYTES = 16
NO_SESSION = bytes(SESSION_BYTES)  # before the head issued a challenge (``Hello``)
_HEADER = struct.Struct(f">{SESSION_BYTES}sQ")


def new_token() -> str:
    """A fresh deployment token (256 random bits, hex)."""
    return secrets.token_hex(32)


def new_session() -> bytes:
    """A fresh registration challenge / control session id (128 random bits)."""
    return secrets.token_bytes(SESSION_BYTES)


class ControlKey:
    def __init__(self, token: str):
        if len(token) < 16:
            raise ValueError("the control-plane token must be at least 16 characters (use new_token())")
        self._key = hashlib.sha256(_CONTEXT + token.encode()).digest()

    def _mac(self, data: bytes) -> bytes:
        return hmac.new(self._key, data, hashlib.sha256).digest()

    def seal(self, payload: bytes) -> list[bytes]:
        return [payload, self._mac(payload)]

    def open(self, frames: list[bytes]) -> bytes | None:
        """The payload of ``[payload, mac]`` if the MAC is right, else None."""
        if len(frames) != 2:
            return None
        payload, mac = frames
        return payload if hmac.compare_digest(self._mac(bytes(payload)), bytes(mac)) else None

    def seal_sequenced(self, session: bytes, seq: int, payload: bytes) -> list[bytes]:
        header = _HEADER.pack(session, seq)
        return [header, payload, self._mac(header + payload)]

    def open_sequenced(self, frames: list[bytes]) -> tuple[bytes, int, bytes] | None:
        """``(session, seq, payload)`` of ``[header, payload, mac]`` if the MAC is right, else None."""
        if len(frames) != 3 or len(frames[0]) != _HEADER.size:
            return None
        header, payload, mac = (bytes(f) for f in frames)
        if not hmac.compare_digest(self._mac(header + payload), mac):
            return None
        session, seq = _HEADER.unpack(header)
        return session, seq, payload


class SequencedSender:
    """One worker socket's side of the envelope: its session and its next sequence number. Used by
    one thread only (a ZMQ socket is not thread-safe); the session is set on registration."""

    def __init__(self, key: ControlKey, send_multipart):
        self.key = key
        self._send = send_multipart
        self.session = NO_SESSION
        self._seq = 0

    def send(self, payload: bytes) -> None:
        self._seq += 1
        self._send(self.key.seal_sequenced(self.session, self._seq, payload))


def write_token(data_dir: Path, token: str) -> Path:
    """The control-plane token where an operator starting remote workers finds it (owner-only)."""
    from triptych.core.private import private_dir

    path = private_dir(data_dir) / "worker.token"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    logger.info('remote workers: triptych worker --token "$(cat %s)" --head %s ...', path, "<control address>")
    return path
