"""The one request lifecycle (``control.lifecycle``) both routers compose, and the typed head
counters (``control.counters``) whose fields are the ``triptych_head_events`` labels."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from triptych.control.attempts import Attempts
from triptych.control.backend import Cancelled, Overloaded, StageFailed
from triptych.control.counters import HeadCounters, LifecycleCounters
from triptych.control.lifecycle import Lifecycle
from triptych.control.request_state import CHAT_TRANSITIONS, TRANSITIONS, RequestMachine, RequestState, StateTimeouts

S = RequestState


@dataclass
class Rec:
    job: SimpleNamespace
    machine: RequestMachine
    future: asyncio.Future
    attempts: Attempts = field(default_factory=Attempts)


def make(kind="request", table=TRANSITIONS, max_queued=2, max_retries=1):
    released: list[tuple[str, str | None]] = []
    counters = LifecycleCounters()
    life = Lifecycle(
        kind=kind,
        table=table,
        timeouts=StateTimeouts(queued_s=5.0),
        max_retries=max_retries,
        max_queued=max_queued,
        counters=counters,
        release=lambda tr, reason: released.append((tr.job.request_id, reason)),
    )
    return life, counters, released


def admit(life, rid):
    tr = Rec(SimpleNamespace(request_id=rid), life.machine(rid), asyncio.get_running_loop().create_future())
    life.admit(tr)
    return tr


def test_each_ending_is_counted_once_and_released_with_a_cancel_unless_done():
    async def scenario():
        life, counters, released = make(max_queued=3)
        a, b, c = (admit(life, rid) for rid in "abc")
        with pytest.raises(Overloaded, match=r"queue is full \(3 requests\)"):
            admit(life, "d")
        life.queue.remove("a")  # placed by its router
        a.machine.to(S.ENCODING)
        life.finish(a, S.FAILED, error=StageFailed("x"))
        assert life.cancel("b") and not life.cancel("b") and not life.cancel("nope")
        c.machine.entered_at -= 10.0  # queued past queued_s
        life.expire(c.machine.entered_at + 10.0)
        assert life.requests == {} and not life.queue
        assert released == [("a", "failed"), ("b", "cancelled"), ("c", "timed_out")]
        assert (counters.failed, counters.cancelled, counters.timed_out, counters.done) == (1, 1, 1, 0)
        assert isinstance(b.future.exception(), Cancelled)
        assert "request timed out in queued after 5.0s" in str(c.future.exception())

    asyncio.run(scenario())


def test_a_retry_goes_to_the_front_under_a_new_generation_until_refused():
    async def scenario():
        life, counters, released = make(kind="chat", table=CHAT_TRANSITIONS)
        first, second = admit(life, "x"), admit(life, "y")
        life.queue.remove("y")
        second.machine.to(S.CHATTING)
        life.retry(second, "enc-0 died", None, "encoder", "enc-0")
        assert list(life.queue) == ["y", "x"] and second.machine.generation == 2
        assert second.attempts.avoid == {"encoder": {"enc-0"}} and counters.retries == 1
        assert released == [("y", "retry: enc-0 died")]
        life.retry(first, "enc-1 died", "no retry: retries exhausted (1)", "encoder", "enc-1")
        assert "x" not in life.requests and counters.failed == 1
        assert str(first.future.exception()) == "enc-1 died; no retry: retries exhausted (1)"
        life.queue.remove("y")  # placed again, on another encoder
        second.machine.to(S.CHATTING)
        life.finish(second, S.DONE, result="answer")
        assert second.future.result() == "answer" and released[-1] == ("y", None) and counters.done == 1

    asyncio.run(scenario())


def test_every_counter_field_is_an_event_label_and_chats_are_prefixed():
    counters = HeadCounters()
    assert counters.labels() == {}  # zeros are left out (``describe()["stats"]`` shows what happened)
    counters.control.replays_refused = 2
    counters.registry.rejoins_requested = 1
    counters.head_stalls = 1
    for i, name in enumerate(LifecycleCounters.__struct_fields__, start=1):
        setattr(counters.generations, name, i)
        setattr(counters.chats, name, 10 * i)
    labels = counters.labels()
    for i, name in enumerate(LifecycleCounters.__struct_fields__, start=1):
        assert labels[name] == i and labels[f"chat_{name}"] == 10 * i
    assert labels["replays_refused"] == 2 and labels["rejoins_requested"] == 1 and labels["head_stalls"] == 1
    assert len(labels) == 2 * len(LifecycleCounters.__struct_fields__) + 3
    with pytest.raises(ValueError):
        LifecycleCounters().count_end(S.QUEUED)
