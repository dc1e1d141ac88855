"""Priority classes and deadlines over real worker processes (tiny FLUX, one instance of each role
with one slot each, so requests start one after another): queued requests start by priority, lower
first, whatever order they came in; one whose deadline passes while it is queued is dropped with
``DeadlineMissed`` and never reaches a worker. Orders only: the waits are liveness bounds."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
from orchestrator_support import Cluster, job, nothing_held, progress_event

from triptych.control.backend import Cancelled, DeadlineMissed
from triptych.deploy.launch import TopologyConfig
from triptych.families.registry import load_family, make_tiny

BLOCKER_STEPS = 5000  # runs until the test cancels it


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    path = make_tiny("flux", tmp_path_factory.mktemp("orch-priority") / "flux")
    c = Cluster(path, TopologyConfig(transfer="zmq", capacity=1))
    yield c, load_family(path)
    c.close()


def test_queued_requests_start_by_priority_and_a_missed_deadline_is_dropped_unrun(cluster):
    c, family = cluster
    on_progress, denoising = progress_event(2)
    blocker = c.submit(job(family, "blocker", seed=1, steps=BLOCKER_STEPS), on_progress)
    assert denoising.wait(300), f"the blocker never denoised: {c.describe()}"
    finished: list[str] = []
    lock = threading.Lock()
    pending = {}
    for rid, priority in [("low", 5), ("mid", 0), ("urgent", -5), ("mid2", 0)]:
        j = job(family, rid, seed=len(pending) + 2, steps=2)
        pending[rid] = c.submit(dataclasses.replace(j, params=j.params.replace(priority=priority)))
        pending[rid].add_done_callback(lambda f, rid=rid: (lock.acquire(), finished.append(rid), lock.release()))
    late = job(family, "late", seed=9, steps=2)
    late = dataclasses.replace(late, deadline_s=0.2, deadline_at=time.monotonic() + 0.2)
    late_future = c.submit(late)
    c.wait_until(lambda d: late_future.done(), "the late request dropped", 60)
    with pytest.raises(DeadlineMissed, match=r"deadline_s=0.2 passed after"):
        late_future.result(60)
    desc = c.describe()
    assert desc["stats"]["deadline_missed"] == 1 and desc["queues"]["encode"] == 4
    c.call(c.backend.cancel("blocker"))
    with pytest.raises(Cancelled):
        blocker.result(120)
    for f in pending.values():
        f.result(300)
    assert finished == ["urgent", "mid", "mid2", "low"]
    c.wait_until(nothing_held, "every slot freed")
