"""The one request lifecycle on the head, composed by both routers (``routing`` for generations,
``chat_router`` for chats): admit into a bounded queue, cancel, expire, retry elsewhere, release,
finish. It owns the table of live requests and their first queue, ends each request exactly once
(its future set, its ending counted in ``LifecycleCounters``), and calls its router's ``release``
to free what that router charged (slots, a second queue) and to ``Cancel`` the workers holding it.
What is placed where, and which message means what, stays with each router.
All state lives on the head's event loop; nothing here takes a lock.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

from triptych.control.attempts import Attempts
from triptych.control.backend import Cancelled, DeadlineMissed, Overloaded, StageFailed
from triptych.control.counters import LifecycleCounters
from triptych.control.fair_queue import FairQueue
from triptych.control.request_state import RequestMachine, RequestState, StateTimeouts

logger = logging.getLogger(__name__)
S = RequestState


class _Job(Protocol):
    request_id: str


class Tracked(Protocol):
    """What the lifecycle reads of a router's record of one request."""

    job: _Job
    machine: RequestMachine
    future: asyncio.Future
    attempts: Attempts


T = TypeVar("T", bound=Tracked)
#: A router's release: free what it charged to the request; with a reason, ``Cancel`` its workers.
Release = Callable[[T, "str | None"], None]


class Lifecycle(Generic[T]):
    def __init__(
        self,
        *,
        kind: str,
        table: dict[RequestState, frozenset[RequestState]],
        timeouts: StateTimeouts,
        max_retries: int,
        max_queued: int,
        counters: LifecycleCounters,
        release: Release,
        waiting: frozenset[RequestState] = frozenset({S.QUEUED}),
    ):
        """``kind`` names the requests in errors and logs ("request", "chat"); ``table`` is their
        ``RequestMachine`` transition table; ``waiting``: the states in which a request has not
        started its main work yet, where a job's passed ``deadline_at`` drops it (``expire``)."""
        self.kind = kind
        self.table = table
        self.timeouts = timeouts
        self.max_retries = max_retries
        self.max_queued = max_queued
        self.counters = counters
        self._release = release
        self.waiting = waiting
        self.requests: dict[str, T] = {}
        #: waiting for their first slot, by (priority, fair share, arrival); retries go to their class's front
        self.queue = FairQueue()

    def machine(self, request_id: str) -> RequestMachine:
        return RequestMachine(request_id, self.timeouts, self.table)

    def admit(self, tracked: T, priority: int = 0, tenant: str = "", weight: float = 1.0) -> None:
        """Into the table and the queue at its place (``fair_queue``: ``priority`` class, then
        ``tenant``'s share of weight ``weight``, then arrival); ``Overloaded`` when the queue is full."""
        if len(self.queue) >= self.max_queued:
            what = "queue" if self.kind == "request" else f"{self.kind} queue"
            raise Overloaded(f"{what} is full ({self.max_queued} requests)", retry_after=1.0)
        rid = tracked.job.request_id
        self.requests[rid] = tracked
        self.queue.add(rid, priority, tenant, weight)

    def cancel(self, request_id: str) -> bool:
        tracked = self.requests.get(request_id)
        if tracked is None:
            return False
        self.finish(tracked, S.CANCELLED, error=Cancelled(request_id))
        return True

    def end_all(self, error: Callable[[str], Exception]) -> None:
        for tracked in list(self.requests.values()):
            self.finish(tracked, S.CANCELLED, error=error(tracked.job.request_id))

    def fail_queued(self, error: Exception, spare: Callable[[T], bool] = lambda tracked: False) -> None:
        """End every request still waiting in the queue with ``error`` (a role it needs is gone),
        but those ``spare`` keeps."""
        for rid in list(self.queue):
            if not spare(self.requests[rid]):
                self.finish(self.requests[rid], S.FAILED, error=error)

    def expire(self, now: float) -> None:
        """End every request past its state's timeout, and every one still ``waiting`` past its
        job's deadline (``deadline_at``; ``DeadlineMissed``)."""
        for tracked in list(self.requests.values()):
            job = tracked.job
            at = getattr(job, "deadline_at", None)
            if at is not None and now >= at and tracked.machine.state in self.waiting:
                self.counters.deadline_missed += 1
                waited = job.deadline_s + now - at
                self.finish(tracked, S.TIMED_OUT, error=DeadlineMissed(job.deadline_s, waited))
        for tracked in [t for t in self.requests.values() if t.machine.expired(now)]:
            state = tracked.machine.state
            limit = tracked.machine.timeouts.for_state(state)
            error = StageFailed(f"{self.kind} timed out in {state.value} after {limit}s")
            self.finish(tracked, S.TIMED_OUT, error=error)

    def backlog(self, now: float) -> tuple[int, float]:
        """The requests waiting in the queue, and how long the longest waiting one has waited."""
        first = min((self.requests[rid].machine.entered_at for rid in self.queue), default=now)
        return len(self.queue), now - first

    def release(self, tracked: T, cancel_reason: str | None) -> None:
        """Out of the queue, and whatever its router charged freed (``Cancel`` sent with a reason)."""
        rid = tracked.job.request_id
        if rid in self.queue:
            self.queue.remove(rid)
        self._release(tracked, cancel_reason)

    def finish(self, tracked: T, state: RequestState, result=None, error: Exception | None = None) -> None:
        """End the request in ``state``: released (its workers told to cancel unless DONE), out of
        the table, counted, its future given ``result`` or ``error``."""
        rid = tracked.job.request_id
        tracked.machine.to(state)
        self.release(tracked, None if state is S.DONE else state.value)
        self.queue.forget(rid)
        del self.requests[rid]
        self.counters.count_end(state)
        if not tracked.future.done():
            if error is not None:
                tracked.future.set_exception(error)
            else:
                tracked.future.set_result(result)
        logger.info("%s %s %s (generation %d)", self.kind, rid, state.value, tracked.machine.generation)

    def retry(self, tracked: T, why: str, refusal: str | None, role: str | None, failed: str | None) -> None:
        """Back to the front of the queue under a new generation, away from ``failed`` (an instance
        of ``role``); with a ``refusal`` (why it may not), FAILED instead."""
        if refusal is not None:
            return self.finish(tracked, S.FAILED, error=StageFailed(f"{why}; {refusal}"))
        self.release(tracked, f"retry: {why}")
        tracked.attempts.record(role, failed)
        tracked.machine.to(S.QUEUED)
        self.queue.readd(tracked.job.request_id)
        self.counters.retries += 1
        logger.warning(
            "retrying %s %s as generation %d: %s", self.kind, tracked.job.request_id, tracked.machine.generation, why
        )
