"""Deadlines on the head: the learned step costs (``control.step_costs``), the estimate and the
refusal at admission (``control.deadlines``), and the drop of a request whose deadline passed while
it waited (``Lifecycle.expire``). Virtual clocks only: every ``now`` is given."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from triptych.control import deadlines
from triptych.control.backend import DeadlineMissed, DeadlineRefused, GenerationJob
from triptych.control.counters import LifecycleCounters
from triptych.control.fair_queue import FairQueue
from triptych.control.lifecycle import Lifecycle
from triptych.control.request_state import TRANSITIONS, RequestMachine, RequestState, StateTimeouts
from triptych.control.step_costs import StepCosts, finish_estimate
from triptych.families.params import GenerationParams

S = RequestState
SMALL, BIG = (64, 64, 1), (128, 128, 1)


def test_a_shape_costs_the_prior_until_reported_then_a_weighted_mean_of_reports():
    costs = StepCosts(prior_s=2.0, alpha=0.5)
    assert costs.step_s(SMALL) == 2.0
    costs.learn(SMALL, 0.4, occupancy=1)
    assert costs.step_s(SMALL) == 0.4 and costs.step_s(BIG) == 2.0  # per shape
    costs.learn(SMALL, 0.8, occupancy=1.2)  # a mean occupancy counts at its nearest whole batch
    assert costs.step_s(SMALL) == pytest.approx(0.6)
    costs.learn(SMALL, 0.0, occupancy=1)  # no measurement (an old worker): ignored
    costs.learn(SMALL, float("nan"), occupancy=1)
    costs.learn(SMALL, 0.5, occupancy=0)
    assert costs.step_s(SMALL) == pytest.approx(0.6) and list(costs.learned[SMALL]) == [1]


def test_a_lone_request_after_batched_reports_is_priced_at_a_lone_tick_not_the_batched_one():
    """Ticks of 8 requests took 0.8 s each: a request alone would take its share of such a tick
    at most (a batch costs no more per request than a smaller one), 0.1 s a step, not 0.8 s: its 10
    steps are estimated at 1 s. Priced at the batched tick (a request's time in the engine over its
    steps), the estimate would be 8 s and a 2 s deadline refused."""
    costs = StepCosts(prior_s=1.0)
    for _ in range(5):
        costs.learn(SMALL, 0.8, occupancy=8)
    assert costs.step_s(SMALL, 1) == pytest.approx(0.1)
    assert finish_estimate(costs, [], (SMALL, 10), slots=8) == pytest.approx(1.0)
    costs.learn(SMALL, 0.15, occupancy=1)  # measured alone: that figure, and linear in between
    assert costs.step_s(SMALL, 1) == 0.15 and costs.step_s(SMALL, 4) == pytest.approx(0.15 + 0.65 * 3 / 7)
    assert costs.step_s(SMALL, 16) == pytest.approx(0.8)  # beyond the largest measured batch: no faster than it


def test_the_estimate_is_the_slower_of_its_own_steps_and_the_throughput_over_the_work():
    costs = StepCosts(prior_s=1.0)
    costs.learn(BIG, 3.0, occupancy=1)
    ahead = [(SMALL, 10), (BIG, 2), (SMALL, -1)]  # a request past its estimated steps adds nothing
    # 4 requests on one denoiser of 2 places: ticks of 2 (SMALL 1 s a tick: prior; BIG 3 s: its
    # largest measured batch); work 10 * 1 + 2 * 3 + 4 * 1 = 20 s of ticks, 2 steps per tick: 10 s
    assert finish_estimate(costs, ahead, (SMALL, 4), slots=2) == pytest.approx(10)
    assert finish_estimate(costs, ahead, (SMALL, 4), slots=4, denoisers=2) == pytest.approx(5)
    assert finish_estimate(costs, [], (BIG, 4), slots=0) == pytest.approx(12)  # alone: its own steps


def params(steps=10, priority=0, size=64):
    return GenerationParams(prompt="x", height=size, width=size, frames=1, steps=steps, priority=priority)


def job(rid, deadline_s=None, now=0.0, **kw):
    at = None if deadline_s is None else now + deadline_s
    return GenerationJob(rid, params(**kw), "png", deadline_s=deadline_s, deadline_at=at)


def fake_router(live, slots=1, prior_s=1.0):
    """``live``: (rid, state, entered_at, job) of the requests the router holds."""
    queue = FairQueue()
    requests = {}
    for rid, state, entered, j in live:
        queue.add(rid, j.params.priority)
        if state is not S.QUEUED:
            queue.take(rid)
        requests[rid] = SimpleNamespace(job=j, machine=SimpleNamespace(state=state, entered_at=entered))
    denoiser = SimpleNamespace(capacity=slots, draining=False)  # one denoiser
    registry = SimpleNamespace(pool=lambda role: [denoiser])
    return SimpleNamespace(
        costs=StepCosts(prior_s=prior_s), requests=requests, wait_encode=queue, registry=registry,
        counters=LifecycleCounters(),
    )  # fmt: skip


def test_a_deadline_the_work_ahead_cannot_meet_is_refused_naming_it_and_the_estimate():
    router = fake_router([("a", S.QUEUED, 0.0, job("a")), ("b", S.DENOISING, 0.0, job("b"))])
    # ahead: a (10 steps) + b (10 steps, 4 done by now=4) = 16 s; its own 10 s: 26 s in all
    with pytest.raises(DeadlineRefused) as e:
        deadlines.check(router, [job("new", deadline_s=20.0, now=4.0)], now=4.0)
    message = str(e.value)
    assert "deadline_s=20 cannot be met" in message and "estimate to finish is 26.0s" in message
    assert "2 requests ahead on 1 denoiser slots" in message
    assert e.value.retry_after == pytest.approx(6.0) and router.counters.deadline_refused == 1
    deadlines.check(router, [job("new", deadline_s=27.0, now=4.0)], now=4.0)  # met: admitted
    deadlines.check(router, [job("new", now=4.0)], now=4.0)  # no deadline: never refused


def test_queued_requests_of_a_later_class_are_not_ahead_and_slots_share_the_work():
    """The urgent request has nothing ahead: its own 10 steps, 10 s. One of the low class has the low
    request ahead: both step together in ticks of 2 on the denoiser's 2 places (unmeasured, 1 s a tick),
    20 request steps at 2 a tick: 10 s as well, and a request of the same class with 1 place (ticks of
    one, FCFS) waits: 20 s."""
    router = fake_router([("low", S.QUEUED, 0.0, job("low", priority=5))], slots=2)
    deadlines.check(router, [job("urgent", deadline_s=10.5, now=0.0, priority=0)], now=0.0)
    deadlines.check(router, [job("same", deadline_s=10.5, now=0.0, priority=5)], now=0.0)
    router = fake_router([("low", S.QUEUED, 0.0, job("low", priority=5))], slots=1)
    with pytest.raises(DeadlineRefused, match=r"estimate to finish is 20.0s \(1 requests ahead"):
        deadlines.check(router, [job("same", deadline_s=10.5, now=0.0, priority=5)], now=0.0)


def test_the_images_of_one_request_count_each_other():
    router = fake_router([], slots=1)
    jobs = [job(f"r-{i}", deadline_s=25.0) for i in range(3)]  # the third finishes after 30 s
    with pytest.raises(DeadlineRefused, match="estimate to finish is 30.0s"):
        deadlines.check(router, jobs, now=0.0)
    deadlines.check(router, jobs[:2], now=0.0)


def lifecycle(released):
    return Lifecycle(
        kind="request",
        table=TRANSITIONS,
        timeouts=StateTimeouts(),
        max_retries=0,
        max_queued=8,
        counters=LifecycleCounters(),
        release=lambda tr, reason: released.append((tr.job.request_id, reason)),
        waiting=frozenset({S.QUEUED, S.ENCODING}),
    )


def test_a_request_whose_deadline_passes_before_denoising_is_dropped_and_freed():
    async def scenario():
        released = []
        life = lifecycle(released)
        loop = asyncio.get_running_loop()
        recs = {}
        for rid, state in [("queued", S.QUEUED), ("encoding", S.ENCODING), ("denoising", S.DENOISING)]:
            machine = RequestMachine(rid, entered_at=100.0)
            rec = SimpleNamespace(job=job(rid, deadline_s=0.3, now=100.0), machine=machine, future=loop.create_future())
            life.admit(rec)
            if state is not S.QUEUED:
                life.queue.take(rid)
                machine.to(S.ENCODING, 100.0)
                if state is S.DENOISING:
                    machine.to(S.DENOISING, 100.1)
            recs[rid] = rec
        life.expire(100.2)  # before the deadline: nothing happens
        assert set(life.requests) == {"queued", "encoding", "denoising"}
        life.expire(100.35)
        assert set(life.requests) == {"denoising"}  # it started denoising: it runs to the end
        assert sorted(released) == [("encoding", "timed_out"), ("queued", "timed_out")]
        error = recs["queued"].future.exception()
        assert isinstance(error, DeadlineMissed) and "deadline_s=0.3 passed after 0.3" in str(error)
        assert life.counters.deadline_missed == 2 and life.counters.timed_out == 2 and not life.queue

    asyncio.run(scenario())


def test_slo_flags_are_a_default_and_per_model_deadlines_checked_on_construction():
    from triptych.head.state import HeadConfig

    assert HeadConfig(data_dir="x", slo=("30", "video=600")).slos() == {None: 30.0, "video": 600.0}
    for bad in ("abc", "video=", "=5", "video=-1", "video=inf", "1e9"):
        with pytest.raises(ValueError, match=r"HeadConfig.slo: .* must be \[MODEL=\]SECONDS"):
            HeadConfig(data_dir="x", slo=(bad,))
    with pytest.raises(ValueError, match="each model once"):
        HeadConfig(data_dir="x", slo=("video=5", "video=6"))
