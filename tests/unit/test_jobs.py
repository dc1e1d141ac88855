"""JobStore (SQLite video records), FileStore expiry, and the metrics update functions."""

from __future__ import annotations

import pytest

from triptych.control.metrics import Metrics, StageStats
from triptych.control.worker_stats import StatsWindow
from triptych.core.errors import InvalidParam
from triptych.head.files import FileStore
from triptych.head.jobs import JobStore, VideoRecord
from triptych.transfer.stats import TransferStats


def rec(job_id, created_at=0, status="queued", **kw):
    return VideoRecord(
        id=job_id,
        created_at=created_at,
        status=status,
        progress=0,
        model="m",
        prompt="p",
        size="32x32",
        seconds="1",
        frames=17,
        **kw,
    )


@pytest.fixture
def store(tmp_path):
    s = JobStore(tmp_path / "jobs.sqlite")
    yield s
    s.close()


def test_insert_get_update_delete(store):
    store.insert(rec("a"))
    assert store.update("a", status="in_progress", progress=40)
    assert (store.get("a").status, store.get("a").progress) == ("in_progress", 40)
    assert store.delete("a") and store.get("a") is None
    assert not store.update("a", progress=50)


def test_reopen_fails_active_jobs_and_keeps_finished(tmp_path, store):
    store.insert(rec("q"))
    store.insert(rec("r", status="in_progress"))
    store.insert(rec("c", status="completed"))
    store.close()
    again = JobStore(tmp_path / "jobs.sqlite")
    assert again.fail_interrupted() == 2
    assert {r.id: (r.status, r.error_code) for r in again.list(10)} == {
        "q": ("failed", "interrupted"),
        "r": ("failed", "interrupted"),
        "c": ("completed", None),
    }
    again.close()


def test_list_pages_in_both_orders(store):
    for i, job_id in enumerate("abcde"):
        store.insert(rec(job_id, created_at=i // 2))  # ties broken by id
    assert [r.id for r in store.list(2, order="asc")] == ["a", "b"]
    assert [r.id for r in store.list(2, after="b", order="asc")] == ["c", "d"]
    assert [r.id for r in store.list(10, after="c", order="desc")] == ["b", "a"]
    with pytest.raises(InvalidParam, match="after"):
        store.list(2, after="zzz")


def test_expired(store):
    store.insert(rec("old", status="completed", expires_at=100))
    store.insert(rec("new", status="completed", expires_at=200))
    store.insert(rec("keep", status="completed"))
    assert store.expired(now=150) == ["old"]


def test_file_store_serves_until_expiry_then_sweeps(tmp_path):
    files = FileStore(tmp_path, ttl_s=60)
    file_id, expires = files.put(b"png-bytes", "png")
    path, media_type = files.get(file_id)
    assert path.read_bytes() == b"png-bytes" and media_type == "image/png"
    assert files.get(file_id, now=expires) is None
    assert files.sweep(now=expires - 1) == 0 and files.sweep(now=expires) == 1
    assert files.get(file_id) is None and files.get("../../etc/passwd") is None


def test_metrics_update_from_stats_objects():
    metrics = Metrics()
    metrics.record_stage(StageStats("denoise", queue_wait_s=0.5, run_s=2.0))
    transfer = TransferStats(backend="zmq")
    transfer.count_push(1024, 0.01)
    metrics.record_worker_window(StatsWindow("den-0", "denoiser", 1.0, None, transfer))
    metrics.update_from_describe(
        {"instances": [{"role": "encoder", "state": "ready"}] * 2, "queues": {"encode": 3}}, head_in_flight=1
    )
    text = metrics.render().decode()
    assert 'triptych_instances{role="encoder",state="ready"} 2.0' in text
    assert 'triptych_queue_depth{stage="encode"} 3.0' in text and 'triptych_queue_depth{stage="head"} 1.0' in text
    assert 'triptych_stage_run_seconds_count{stage="denoise"}' in text
    assert 'triptych_transfer_bytes_total{backend="zmq"}' in text
    metrics.update_from_describe(
        {"instances": [{"role": "decoder", "assigned": 2}, {"role": "decoder", "assigned": 0}]}
    )
    text = metrics.render().decode()
    assert 'triptych_instances{role="decoder",state="busy"} 1.0' in text and 'state="idle"} 1.0' in text
    metrics.update_from_describe({"stats": {"retries": 2}, "local_workers": {"restarts": 1}})
    metrics.update_from_describe({"stats": {"retries": 3}, "local_workers": {"restarts": 1}})
    text = metrics.render().decode()
    assert 'triptych_head_events_total{event="retries"} 3.0' in text
    assert 'triptych_head_events_total{event="worker_restarts"} 1.0' in text
    metrics.update_from_describe({})  # a fresh snapshot drops stale label sets
    assert 'role="encoder"' not in metrics.render().decode()
    with pytest.raises(AssertionError):
        metrics.record_request("/x", "weird")
