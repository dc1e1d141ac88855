"""Cancel mid-denoise, kill -9 a denoiser mid-request (retry elsewhere, the dead one replaced), kill
the last one (its request waits for the replacement and completes), a role gone for good (503 at once, not after the queue
timeout), a head killed with SIGKILL (no orphans), a stalled worker (rejoins).

The tests sharing the 1:2:1 topology leave it as they found it (a killed worker is restarted), so
they pass in any order; counters are compared as deltas.
"""

from __future__ import annotations

import pytest
from orchestrator_support import Cluster, holder_of, job, nothing_held, progress_event

from triptych.control.backend import Cancelled, Unavailable
from triptych.control.orchestrator import OrchestratorConfig
from triptych.core.media import encode_frames
from triptych.deploy.launch import TopologyConfig
from triptych.engine.runner import run_request
from triptych.families.registry import load_family, make_tiny

LONG = 600  # steps: long enough that the request is mid-denoise when the test acts


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = make_tiny("flux", tmp_path_factory.mktemp("orch-faults") / "flux")
    return path, load_family(path)


@pytest.fixture(scope="module")
def cluster(model):
    topology = TopologyConfig(encoders=1, denoisers=2, decoders=1, transfer="zmq", capacity=2, restart_backoff_s=0.5)
    c = Cluster(model[0], topology)
    yield c
    c.close()


def start_long(cluster, family, rid: str, seed: int = 0):
    on_progress, reached = progress_event(3)
    j = job(family, rid, seed=seed, steps=LONG)
    pending = cluster.submit(j, on_progress)
    assert reached.wait(300), f"{rid} never reported denoising progress: {cluster.describe()}"
    return j, pending


def replaced(cluster, victim: str, old_pid: int) -> dict:
    """Wait (a liveness bound: the 30 s docs/reliability.md promises) until ``victim`` runs again in a new process."""
    return cluster.wait_until(
        lambda d: any(i["id"] == victim and i["pid"] != old_pid for i in d["instances"]) and nothing_held(d),
        f"{victim} restarted and registered again",
        timeout=30,
    )


def pid_of(desc: dict, instance_id: str) -> int:
    (pid,) = [i["pid"] for i in desc["instances"] if i["id"] == instance_id]
    return pid


def test_cancel_mid_denoise_frees_everything(cluster, model):
    _, family = model
    before = cluster.describe()["stats"].get("cancelled", 0)
    _, pending = start_long(cluster, family, "cancel-1")
    assert cluster.describe()["requests"] == {"denoising": 1}
    assert cluster.call(cluster.backend.cancel("cancel-1")) is True
    with pytest.raises(Cancelled):
        pending.result(60)
    desc = cluster.wait_until(nothing_held, "slots, held tensors and engine state freed after cancel")
    assert desc["stats"]["cancelled"] == before + 1
    assert cluster.call(cluster.backend.cancel("cancel-1")) is False


def test_killed_denoiser_request_completes_on_the_other_and_the_dead_one_is_replaced(cluster, model):
    _, family = model
    stats = cluster.describe()["stats"]
    j, pending = start_long(cluster, family, "kill-1", seed=4)
    desc = cluster.describe()
    victim = holder_of(desc, "kill-1", "denoiser")
    old_pid = pid_of(desc, victim)
    cluster.on_loop(cluster.backend.kill, victim)
    data = pending.result(600)
    frames, _ = run_request(family, j.params, request_id=j.request_id)
    assert data == encode_frames(frames.to_uint8(), "png")  # the retry is the same seeded computation
    desc = replaced(cluster, victim, old_pid)
    assert desc["stats"]["retries"] == stats.get("retries", 0) + 1
    assert desc["stats"]["instances_lost"] == stats.get("instances_lost", 0) + 1
    assert desc["local_workers"]["workers"][victim]["restarts_in_window"] >= 1


def test_killing_the_last_denoiser_its_request_waits_for_the_replacement_and_completes_exactly(model):
    """No other denoiser: the request waits (``replacement_wait_s``) for the supervisor's restart of
    the killed one and completes on it with the bytes of an undisturbed run."""
    path, family = model
    topology = TopologyConfig(encoders=1, denoisers=1, decoders=1, transfer="zmq", capacity=2, restart_backoff_s=0.5)
    cluster = Cluster(path, topology)
    try:
        j, pending = start_long(cluster, family, "kill-2", seed=6)
        desc = cluster.describe()
        victim = holder_of(desc, "kill-2", "denoiser")
        old_pid = pid_of(desc, victim)
        cluster.on_loop(cluster.backend.kill, victim)
        data = pending.result(600)
        frames, _ = run_request(family, j.params, request_id=j.request_id)
        assert data == encode_frames(frames.to_uint8(), "png")
        desc = replaced(cluster, victim, old_pid)
        assert desc["stats"]["replacement_waits"] == 1 and desc["stats"]["retries"] == 1
        assert "failed" not in desc["stats"]
    finally:
        cluster.close()


def test_a_role_gone_for_good_fails_requests_at_once_with_unavailable(model):
    """No denoiser for longer than ``unavailable_after_s`` (restarts off): a request queued before
    the grace ran out and one submitted after both get ``Unavailable`` (HTTP 503), not a 300 s wait."""

    path, family = model
    config = OrchestratorConfig(heartbeat_interval_s=0.2, heartbeat_timeout_s=2.0, unavailable_after_s=3.0)
    topology = TopologyConfig(encoders=1, denoisers=1, decoders=1, transfer="zmq", restart=False)
    cluster = Cluster(path, topology, config)
    try:
        (den,) = [i["id"] for i in cluster.describe()["instances"] if i["role"] == "denoiser"]
        cluster.on_loop(cluster.backend.kill, den)
        cluster.wait_until(lambda d: d["empty_roles"] == ["denoiser"], "the dead denoiser noticed")
        queued = cluster.submit(job(family, "queued-1", seed=1))
        with pytest.raises(Unavailable, match="denoiser"):  # Unavailable, not the queue timeout's error
            queued.result(60)
        with pytest.raises(Unavailable, match="denoiser"):
            cluster.submit(job(family, "late-1", seed=2)).result(10)
        cluster.wait_until(nothing_held, "nothing held after the refusals")
    finally:
        cluster.close()


HEAD_SCRIPT = """
import asyncio, json, sys
from triptych.deploy.launch import EmbeddedBackend, TopologyConfig
from triptych.control.orchestrator import OrchestratorConfig

async def main():
    backend = EmbeddedBackend(sys.argv[1], OrchestratorConfig(heartbeat_interval_s=0.2, heartbeat_timeout_s=2.0),
                              TopologyConfig(transfer="zmq", torch_threads=1))
    await backend.start()
    print(json.dumps({i: p.pid for i, p in backend.workers.procs.items()}), flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


def test_workers_of_a_head_killed_with_sigkill_exit_on_their_own(model, tmp_path):
    """kill -9 of the head runs none of its cleanup; the workers it spawned notice their parent is
    gone (``--exit-with-parent``) and exit instead of holding memory and devices forever."""
    import json
    import os
    import signal
    import subprocess
    import sys

    from tests.procs import alive, wait_gone

    head = subprocess.Popen([sys.executable, "-c", HEAD_SCRIPT, str(model[0])], stdout=subprocess.PIPE, text=True)
    try:
        pids = json.loads(head.stdout.readline())
        assert sorted(pids) == ["decoder-0", "denoiser-0", "encoder-0"]

        assert all(alive(p) for p in pids.values())
        head.send_signal(signal.SIGKILL)
        head.wait(30)
        # a liveness bound: heartbeat interval + the loop's stop (a zombie, reaped by init or not yet, has exited)
        left = wait_gone(pids.values(), 60)
        assert not [i for i, p in pids.items() if p in left], "orphaned workers still running"
    finally:
        head.kill()
        head.wait(30)
        for pid in pids.values() if "pids" in locals() else ():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_a_worker_declared_dead_while_only_stalled_rejoins_and_serves(model):
    """SIGSTOP a denoiser past the heartbeat timeout (a stalled process, a partition): the head declares
    it dead; its request waits for a denoiser (no other is registered). On SIGCONT the worker's next
    heartbeat gets a ``Rejoin``; it drops the stale job, registers again under its id, and the waiting
    request completes on it exactly; nothing is left held."""
    import signal

    path, family = model
    cluster = Cluster(path, TopologyConfig(transfer="zmq", capacity=2))
    try:
        j, pending = start_long(cluster, family, "stall-1", seed=8)
        victim = holder_of(cluster.describe(), "stall-1", "denoiser")
        cluster.on_loop(cluster.backend.kill, victim, signal.SIGSTOP)
        cluster.wait_until(lambda d: d["stats"].get("instances_lost") == 1, "the stalled denoiser declared dead")
        assert not pending.done() and victim not in {i["id"] for i in cluster.describe()["instances"]}
        cluster.on_loop(cluster.backend.kill, victim, signal.SIGCONT)
        data = pending.result(600)
        frames, _ = run_request(family, j.params, request_id=j.request_id)
        assert data == encode_frames(frames.to_uint8(), "png")
        desc = cluster.describe()
        assert desc["stats"]["rejoins_requested"] >= 1 and desc["stats"]["instances_lost"] == 1
        assert desc["stats"]["replacement_waits"] == 1
        cluster.wait_until(nothing_held, "nothing held after the rejoin and the request")
    finally:
        cluster.close()
