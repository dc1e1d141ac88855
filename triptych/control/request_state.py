"""Request lifecycle on the head: an explicit state machine with a transition table and timeouts.

    generation:  QUEUED ──▶ ENCODING ──▶ DENOISING ──▶ DECODING ──▶ DONE
    chat:        QUEUED ──▶ CHATTING ──────────────────────────────▶ DONE
                    │          │             │             │
                    └──────────┴─────────────┴─────────────┴──▶ FAILED | CANCELLED | TIMED_OUT

An active stage may also go back to QUEUED: a retry after the instance serving it died. A retry
bumps the generation, so messages of the old generation are recognised and dropped. Terminal
states have no way out. Every other move raises ``InvalidTransition``.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from triptych.core.errors import TriptychError


class RequestState(str, enum.Enum):
    QUEUED = "queued"
    ENCODING = "encoding"
    DENOISING = "denoising"
    DECODING = "decoding"
    CHATTING = "chatting"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"
    TIMED_OUT = "timed_out"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL


TERMINAL = frozenset({RequestState.DONE, RequestState.FAILED, RequestState.CANCELLED, RequestState.TIMED_OUT})
ACTIVE = frozenset(RequestState) - TERMINAL
_ENDS = {RequestState.FAILED, RequestState.CANCELLED, RequestState.TIMED_OUT}

S = RequestState
_TERMINAL_MOVES = {S.DONE: frozenset(), S.FAILED: frozenset(), S.CANCELLED: frozenset(), S.TIMED_OUT: frozenset()}
TRANSITIONS: dict[RequestState, frozenset[RequestState]] = {
    S.QUEUED: frozenset({S.ENCODING} | _ENDS),
    S.ENCODING: frozenset({S.DENOISING, S.QUEUED} | _ENDS),
    S.DENOISING: frozenset({S.DECODING, S.QUEUED} | _ENDS),
    S.DECODING: frozenset({S.DONE, S.QUEUED} | _ENDS),
    S.CHATTING: frozenset(),
    **_TERMINAL_MOVES,
}
"""A generation's table (the default)."""
CHAT_TRANSITIONS: dict[RequestState, frozenset[RequestState]] = {
    **{state: frozenset() for state in RequestState},
    S.QUEUED: frozenset({S.CHATTING} | _ENDS),
    S.CHATTING: frozenset({S.DONE, S.QUEUED} | _ENDS),
    **_TERMINAL_MOVES,
}
"""A chat's table: one stage, on a chat-capable encoder."""


class InvalidTransition(TriptychError):
    """A state change that the transition table does not allow."""

    def __init__(self, request_id: str, src: RequestState, dst: RequestState):
        self.request_id, self.src, self.dst = request_id, src, dst
        super().__init__(f"request {request_id!r}: invalid transition {src.value} -> {dst.value}")


@dataclass(frozen=True)
class StateTimeouts:
    """Longest time a request may stay in each active state before it is TIMED_OUT."""

    queued_s: float = 300.0
    """Waiting for instances with free capacity (also covers 'no worker registered yet')."""
    encoding_s: float = 120.0
    """Encode plus the conditioning handoff to the denoiser."""
    denoising_s: float = 1800.0
    """All denoising steps plus the latent handoff to the decoder."""
    decoding_s: float = 300.0
    """VAE decode plus media encoding."""
    chatting_s: float = 600.0
    """A chat answer, from its first token to its last."""

    def __post_init__(self) -> None:
        for name in ("queued_s", "encoding_s", "denoising_s", "decoding_s", "chatting_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"StateTimeouts.{name}={getattr(self, name)} must be > 0 seconds")

    def for_state(self, state: RequestState) -> float | None:
        return {
            S.QUEUED: self.queued_s,
            S.ENCODING: self.encoding_s,
            S.DENOISING: self.denoising_s,
            S.DECODING: self.decoding_s,
            S.CHATTING: self.chatting_s,
        }.get(state)


@dataclass
class RequestMachine:
    """The lifecycle of one request: current state, generation, and when the state was entered.

    ``generation`` starts at 1 and grows by one on every retry (a move back to QUEUED).
    """

    request_id: str
    timeouts: StateTimeouts = field(default_factory=StateTimeouts)
    table: dict[RequestState, frozenset[RequestState]] = field(default_factory=lambda: TRANSITIONS, repr=False)
    """``TRANSITIONS`` (a generation) or ``CHAT_TRANSITIONS``."""
    state: RequestState = RequestState.QUEUED
    generation: int = 1
    entered_at: float = field(default_factory=time.monotonic)
    history: list[RequestState] = field(default_factory=lambda: [RequestState.QUEUED])

    def can(self, dst: RequestState) -> bool:
        return dst in self.table[self.state]

    def to(self, dst: RequestState, now: float | None = None) -> None:
        """Move to ``dst``; raises ``InvalidTransition`` if the table forbids it."""
        if not self.can(dst):
            raise InvalidTransition(self.request_id, self.state, dst)
        if dst is RequestState.QUEUED:
            self.generation += 1
        self.state = dst
        self.entered_at = time.monotonic() if now is None else now
        self.history.append(dst)

    def deadline(self) -> float | None:
        limit = self.timeouts.for_state(self.state)
        return None if limit is None else self.entered_at + limit

    def expired(self, now: float) -> bool:
        deadline = self.deadline()
        return deadline is not None and now >= deadline
