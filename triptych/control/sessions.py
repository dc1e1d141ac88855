"""Freshness of worker → head control frames: the head's table of registration challenges and
control sessions.

A signed frame proves only that a token holder made it once; a captured ``Register`` or
``Heartbeat`` replayed later would pass the MAC. So registration is a challenge-response: the
worker sends ``Hello``, the head answers a random 128-bit ``Challenge`` bound to the asking socket
(its ZMQ identity), and only a ``Register`` sealed under that nonce, from that socket, within
``challenge_ttl_s``, is admitted; the nonce is spent by its first use. A challenge-response was
chosen over worker-made nonces with timestamps because it needs no clock agreement between hosts and
no memory of every nonce seen: the head keeps only the challenges it issued and has not yet seen
used, a bounded set.

The admitted nonce becomes the instance's session. Every later frame carries it and a sequence
number that grows with each frame its socket sends (``auth``); the head accepts a frame only if its
session is the instance's current one, it comes from a socket bound to that session (the
registering socket and the ``channels`` its ``Register`` named), and its sequence number is larger
than the last one accepted from that socket (ZMQ keeps a socket's frames in order). Anything else is
a replay or a frame from another process and is dropped (``check`` says why). Sessions of instances
that died are kept (bounded) so a replay of their frames is recognised as one, and a worker that was
only silent (its frames still fresh) is told to rejoin.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum

from cachetools import FIFOCache

from triptych.control.auth import new_session


class Verdict(Enum):
    OK = "ok"  # the current session of a live instance, a bound socket, a fresh sequence number
    ORPHAN = "orphan"  # fresh, but its instance is not registered (declared dead, or a restarted head)
    REPLAY = "replay"  # an old sequence number, or a socket the session is not bound to
    STALE = "stale"  # a session its instance has replaced by a newer registration


@dataclass
class _Session:
    instance_id: str
    last_seq: dict[bytes, int] = field(default_factory=dict)  # bound socket identity -> last accepted seq
    live: bool = True


class SessionTable:
    def __init__(self, challenge_ttl_s: float = 60.0, max_pending: int = 1024, max_sessions: int = 4096):
        self.challenge_ttl_s = challenge_ttl_s
        self.max_pending = max_pending
        self.max_sessions = max_sessions
        # Both bounded, the oldest forgotten first. Pending: identity -> (nonce, instance id, expiry).
        self._pending: FIFOCache[bytes, tuple[bytes, str, float]] = FIFOCache(max_pending)
        self._sessions: FIFOCache[bytes, _Session] = FIFOCache(max_sessions)
        self._current: dict[str, bytes] = {}  # live instance id -> its session

    def challenge(self, identity: bytes, instance_id: str, now: float | None = None) -> bytes:
        """A fresh nonce for ``identity``'s next ``Register`` (replacing one it was given before)."""
        now = time.monotonic() if now is None else now
        nonce = new_session()
        self._pending.pop(identity, None)
        self._pending[identity] = (nonce, instance_id, now + self.challenge_ttl_s)
        return nonce

    def admit(self, identity: bytes, session: bytes, instance_id: str, now: float | None = None) -> str | None:
        """Spend ``identity``'s challenge on a ``Register`` sealed under ``session``; None if it was the
        challenge issued to this socket for this instance and still fresh, else why not."""
        now = time.monotonic() if now is None else now
        pending = self._pending.pop(identity, None)
        if pending is None:
            return "no challenge outstanding for this socket (a replayed or unsolicited Register)"
        nonce, asked_for, expiry = pending
        if nonce != session or asked_for != instance_id:
            return "sealed under another challenge than the one issued to this socket"
        if now > expiry:
            return f"its challenge expired ({self.challenge_ttl_s:.0f}s)"
        return None

    def bind(self, instance_id: str, session: bytes, identities: list[bytes], first_seq: dict[bytes, int]) -> None:
        """``instance_id`` registered under ``session``; only ``identities`` speak for it from now on."""
        self.retire(instance_id)
        self._sessions[session] = _Session(instance_id, {i: first_seq.get(i, 0) for i in identities})
        self._current[instance_id] = session

    def retire(self, instance_id: str) -> None:
        """``instance_id`` left (declared dead or removed): its session stays known, not live."""
        session = self._current.pop(instance_id, None)
        if session is not None and session in self._sessions:
            self._sessions[session].live = False

    def check(self, identity: bytes, session: bytes, seq: int, instance_id: str) -> Verdict:
        """Whether a (MAC-checked) frame for ``instance_id`` may be handled; an accepted frame's ``seq``
        becomes its socket's last."""
        known = self._sessions.get(session)
        current = self._current.get(instance_id)
        if known is None:  # never issued here (a restarted head) or long forgotten
            return Verdict.STALE if current is not None else Verdict.ORPHAN
        if known.instance_id != instance_id or identity not in known.last_seq or seq <= known.last_seq[identity]:
            return Verdict.REPLAY
        if current is not None and current != session:
            return Verdict.STALE
        known.last_seq[identity] = seq
        return Verdict.OK if known.live else Verdict.ORPHAN

    def describe(self) -> dict:
        return {"pending_challenges": len(self._pending), "sessions": len(self._sessions), "live": len(self._current)}
