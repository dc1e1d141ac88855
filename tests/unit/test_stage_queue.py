"""A stage worker's ready queue (``StageRunner.enqueue``): by priority class, arrival order inside one."""

from __future__ import annotations

from types import SimpleNamespace

from triptych.worker.runners.base import StageRunner


def job(rid: str, priority: int | None):
    return SimpleNamespace(request_id=rid, params=None if priority is None else SimpleNamespace(priority=priority))


def test_a_more_urgent_job_is_computed_before_queued_less_urgent_ones_and_fifo_holds_inside_a_class():
    runner = StageRunner(family=None, port=None)
    for rid, p in (("flood1", 10), ("flood2", 10), ("urgent1", 0), ("chat", None), ("urgent2", 0), ("flood3", 10)):
        runner.enqueue(job(rid, p))
    assert [j.request_id for j in runner.ready] == ["urgent1", "chat", "urgent2", "flood1", "flood2", "flood3"]
    runner.enqueue(job("first", -1))
    assert runner.ready[0].request_id == "first"
