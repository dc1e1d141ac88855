"""A retry with nowhere else to go: the instance serving a request died and no other instance of its
role is registered, so the retry waits for one to register (a supervisor's restart under the same
id, a scaler's new worker, a stalled worker rejoining) instead of failing at once. A live instance
that failed the request itself (a retryable ``StageError``) while it is the only one of its role
fails the request at once, as before: nothing says another will register.

The wait is bounded by the earlier of the backend's ``replacement_wait_s`` and the request's own
deadline (``GenerationJob.deadline``); past the bound the request fails with an error naming which
bound it was. While it waits the request holds nothing of the dead attempt: its slots were freed
and its workers told to cancel when the attempt ended (the router's release).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from triptych.control.dispatch import Instance


@dataclass(frozen=True)
class ReplacementWait:
    """A retried request waiting for an instance of ``role`` to register, until ``until``."""

    role: str
    why: str  # what ended the attempt before the wait
    until: float  # time.monotonic() past which the request fails
    bound: str  # what set ``until``, for the error
    passed: bool = False  # ``until`` was past already when the wait was planned: no wait at all

    def refusal(self) -> str:
        """Why no instance took the retry (the end of ``error``)."""
        return f"no {self.role} instance registered within {self.bound}"

    def error(self) -> str:
        """The request's error once the wait ran out: the attempt's failure, then the bound."""
        return f"{self.why}; {self.refusal()}"


def replacement_wait(role: str, why: str, now: float, wait_s: float, deadline: float | None) -> ReplacementWait:
    """The wait of a retry that needs a new instance of ``role``: ``wait_s`` from ``now``, cut short
    by ``deadline`` (a ``time.monotonic()`` value, or None); ``passed`` when that leaves no wait."""
    until = now + wait_s
    bound = f"replacement_wait_s={wait_s:g}s (--replacement-wait-s)"
    if deadline is not None and deadline < until:
        left = max(0.0, deadline - now)
        until, bound = deadline, f"the request's deadline (request_timeout_s; {left:.1f}s were left)"
    return ReplacementWait(role, why, until, bound, passed=until <= now)


def plan_retry(
    role: str,
    failed: str | None,
    instances: Mapping[str, Instance],
    why: str,
    now: float,
    wait_s: float,
    deadline: float | None,
) -> tuple[str | None, ReplacementWait | None]:
    """(refusal, wait) of a retry away from ``failed``, an instance of ``role`` (``instances``: the
    registered ones, id -> ``Instance``): neither while another instance of the role is registered;
    a refusal while ``failed`` itself is registered (it failed the request, alive) or when the
    deadline passed already; else the wait for a registration."""
    if [i for iid, i in instances.items() if i.role == role and iid != failed]:
        return None, None
    if failed in instances:
        return f"no other {role} instance is registered", None
    wait = replacement_wait(role, why, now, wait_s, deadline)
    return (wait.refusal(), None) if wait.passed else (None, wait)
