"""The autoscaling policy (a pure function, one behaviour per test) and the ``Autoscaler`` loop with
10-line fakes: it adds one instance at a time, drains before it stops, and never stops an instance
that still holds a request."""

from __future__ import annotations

import pytest

from triptych.control.orchestrator import PoolLoad
from triptych.deploy.autoscale import Autoscaler, decide
from triptych.deploy.config import AutoscaleConfig

C = AutoscaleConfig(pools=("denoiser=1:3",), up_queue=2, up_wait_s=2.0, down_idle_s=10.0)


def test_grows_when_enough_requests_wait():
    assert decide(queue_depth=2, oldest_wait_s=0.0, instances=1, idle_s=0.0, lo=1, hi=3, config=C) == 1


def test_grows_when_one_request_waited_long():
    assert decide(1, 2.0, 1, 0.0, 1, 3, C) == 1
    assert decide(1, 1.9, 1, 0.0, 1, 3, C) == 0


def test_never_grows_past_max():
    assert decide(50, 60.0, 3, 0.0, 1, 3, C) == 0


def test_shrinks_after_the_idle_period_only():
    assert decide(0, 0.0, 2, 10.0, 1, 3, C) == -1
    assert decide(0, 0.0, 2, 9.9, 1, 3, C) == 0


def test_never_shrinks_below_min_or_with_a_queue():
    assert decide(0, 0.0, 1, 100.0, 1, 3, C) == 0
    assert decide(1, 0.1, 2, 100.0, 1, 3, C) == 0


def test_restores_the_bounds():
    assert decide(0, 0.0, 0, 0.0, 1, 3, C) == 1
    assert decide(0, 0.0, 4, 0.0, 1, 3, C) == -1


@pytest.mark.parametrize("spec", ["denoiser=3:1", "painter=1:2", "denoiser=1", "denoiser=a:b", "denoiser=0:0"])
def test_a_bad_pool_spec_is_refused_naming_the_field(spec):
    with pytest.raises(ValueError, match="pools="):
        AutoscaleConfig(pools=(spec,))


class FakeOrchestrator:
    def __init__(self):
        self.instances, self.held, self.queue, self.drained, self.stopped = {}, {}, 0, set(), []

    def load(self, role, now):
        live = tuple(sorted(i for i in self.instances if i not in self.drained))
        idle = tuple(i for i in live if not self.held.get(i))
        return PoolLoad(
            self.queue, 5.0 if self.queue else 0.0, live, idle, {i: self.held.get(i, 0) for i in self.drained}
        )

    def drain(self, iid):
        self.drained.add(iid)

    def stop(self, iid, reason):
        self.stopped.append(iid)


class FakePool:
    def __init__(self):
        self.ids, self.retired = [], set()

    def spawn(self, role, head):
        self.ids.append(f"{role}-{len(self.ids)}")
        return self.ids[-1]

    def current(self, role):
        return [i for i in self.ids if i not in self.retired]

    def retire(self, iid):
        self.retired.add(iid)


def scaler():
    orch, pool = FakeOrchestrator(), FakePool()
    pool.spawn("denoiser", "h")
    orch.instances["denoiser-0"] = object()
    return Autoscaler(orch, pool, "h", C), orch, pool


def test_adds_one_at_a_time_until_the_new_one_registered():
    a, orch, pool = scaler()
    orch.queue = 5
    assert a.step(0.0) == {"denoiser": 1}
    assert a.step(1.0) == {"denoiser": 0} and len(pool.ids) == 2  # denoiser-1 still starting
    orch.instances["denoiser-1"] = object()
    assert a.step(2.0) == {"denoiser": 1} and len(pool.ids) == 3


def test_drains_first_and_stops_only_once_nothing_is_held():
    a, orch, pool = scaler()
    pool.spawn("denoiser", "h")
    orch.instances["denoiser-1"] = object()
    orch.held = {"denoiser-0": 1}
    a.step(0.0)
    assert a.step(10.0) == {"denoiser": -1} and orch.drained == {"denoiser-1"}  # the idle one
    orch.held["denoiser-1"] = 1  # it still finishes a request it held (a test-only twist)
    a.step(11.0)
    assert orch.stopped == [] and pool.retired == set()
    orch.held["denoiser-1"] = 0
    a.step(12.0)
    assert orch.stopped == ["denoiser-1"] and pool.retired == {"denoiser-1"}
