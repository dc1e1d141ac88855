"""The head's event loop (issue 24, item 3): its lag is measured and exported, a stall of the loop is
not counted as the workers' silence, and large data URLs decode in pieces the loop can run between."""

from __future__ import annotations

import asyncio
import base64
import os
import time

import pytest

from triptych.control.dispatch import Instance
from triptych.control.metrics import LoopMetrics
from triptych.core import media, offload
from triptych.head.state import Head, HeadConfig


def test_loop_metrics_keep_the_latest_and_the_largest_lag():
    m = LoopMetrics()
    for lag in (0.01, 0.7, 0.02):
        m.record_loop_lag(lag)
    text = m.render().decode()
    assert "triptych_head_event_loop_lag_last_seconds 0.02" in text
    assert "triptych_head_event_loop_lag_max_seconds 0.7" in text
    assert "triptych_head_event_loop_lag_seconds_count 3.0" in text


def test_a_blocked_loop_shows_as_lag(tmp_path):
    """The loop held 0.5 s (a blocking call on it): the watcher's sleep, asked to end 0.1 s after it
    began (at or before the block), ends after it: a lag of at least 0.4 s is recorded."""
    from tests.e2e.http_support import FakeBackend, FakeFamily

    head = Head({"m": FakeBackend(FakeFamily(tmp_path))}, HeadConfig(data_dir=tmp_path))

    async def scenario():
        watcher = asyncio.create_task(head.watch_loop_forever(every_s=0.1))
        await asyncio.sleep(0)  # the watcher starts its sleep
        time.sleep(0.5)  # noqa: ASYNC251 - the point: a call that holds the loop
        await asyncio.sleep(0.2)
        watcher.cancel()

    asyncio.run(scenario())
    assert head.loop_metrics._max >= 0.4


def test_a_stall_of_the_head_is_not_counted_as_worker_silence(tiny_model_dir):
    from triptych.control.orchestrator import Orchestrator, OrchestratorConfig

    orch = Orchestrator(tiny_model_dir("flux"), OrchestratorConfig(heartbeat_interval_s=0.5, heartbeat_timeout_s=5.0))
    now = time.monotonic()
    orch.registry.instances["den-0"] = Instance("den-0", "denoiser", 1, "c", "d", "zmq", 1, now - 4.0)
    orch._excuse_stall(0.3)  # an ordinary late tick: nothing excused
    assert orch.registry.instances["den-0"].last_seen == now - 4.0
    orch._excuse_stall(6.0)  # the loop was held 6 s: without the excuse den-0 is silent 10 s, declared dead
    assert orch.registry.silent(time.monotonic() + 2.0, 5.0) == []
    assert orch.counters.head_stalls == 1


@pytest.mark.parametrize("size", [0, 1, 5, 3 * 1024 * 1024 + 1])
def test_a_large_data_url_decodes_in_pieces_to_the_same_bytes(size):
    raw = os.urandom(size)
    text = base64.b64encode(raw).decode()
    assert media._b64decode(text) == raw
    if size > media._B64_CHUNK:  # padding inside is refused as the one-call decode refuses it
        with pytest.raises(ValueError):
            media._b64decode(text[:8] + "=" + text[9:])


def test_offload_runs_in_its_threads_and_returns_what_they_raise():
    import threading

    offload.configure(2)

    async def scenario():
        name = await offload.run(lambda: threading.current_thread().name)
        with pytest.raises(ZeroDivisionError):
            await offload.run(lambda: 1 / 0)
        return name

    assert asyncio.run(scenario()).startswith("head-media")
