"""Authenticated control frames: every control message carries an HMAC-SHA256 of its bytes under a key
derived from the deployment's token. Only holders of the token can register, and a frame that fails
the check is dropped (and counted) before it is decoded. ``serve`` makes a token for its local
workers; remote workers are given it (``--token`` or ``$TRIPTYCH_TOKEN``).

Frames on the wire: ``[payload, mac]`` (a ROUTER sees ``[identity, payload, mac]``). The MAC binds
the bytes, not their freshness: a replayed frame of an old request generation is dropped as stale
by the head; see the README for what this does not cover.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
from pathlib import Path

logger = logging.getLogger(__name__)

_CONTEXT = b"triptych control plane v1\0"


def new_token() -> str:
    """A fresh deployment token (256 random bits, hex)."""
    return secrets.token_hex(32)


class ControlKey:
    def __init__(self, token: str):
        if len(token) < 16:
            raise ValueError("the control-plane token must be at least 16 characters (use new_token())")
        self._key = hashlib.sha256(_CONTEXT + token.encode()).digest()

    def seal(self, payload: bytes) -> list[bytes]:
        return [payload, hmac.new(self._key, payload, hashlib.sha256).digest()]

    def open(self, frames: list[bytes]) -> bytes | None:
        """The payload of ``[payload, mac]`` if the MAC is right, else None."""
        if len(frames) != 2:
            return None
        payload, mac = frames
        good = hmac.new(self._key, payload, hashlib.sha256).digest()
        return payload if hmac.compare_digest(good, bytes(mac)) else None


def write_token(data_dir: Path, token: str) -> Path:
    """The control-plane token where an operator starting remote workers finds it (owner-only)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    path = data_dir / "worker.token"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    logger.info('remote workers: triptych worker --token "$(cat %s)" --head %s ...', path, "<control address>")
    return path
