"""Cancel mid-denoise, kill -9 a denoiser mid-request (retry elsewhere), kill the last one (clear error).

The tests share one 1:2:1 topology and run in file order: each kill removes a denoiser.
"""

from __future__ import annotations

import pytest
from orchestrator_support import Cluster, holder_of, job, nothing_held, progress_event

from triptych.pipelines.registry import load_family, make_tiny
from triptych.pipelines.runner import run_request
from triptych.server.backend import Cancelled, StageFailed
from triptych.server.launch import TopologyConfig
from triptych.server.media import encode_frames

LONG = 600  # steps: long enough that the request is mid-denoise when the test acts


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = make_tiny("flux", tmp_path_factory.mktemp("orch-faults") / "flux")
    return path, load_family(path)


@pytest.fixture(scope="module")
def cluster(model):
    c = Cluster(model[0], TopologyConfig(encoders=1, denoisers=2, decoders=1, transfer="zmq", capacity=2))
    yield c
    c.close()


def start_long(cluster, family, rid: str, seed: int = 0):
    on_progress, reached = progress_event(3)
    j = job(family, rid, seed=seed, steps=LONG)
    pending = cluster.submit(j, on_progress)
    assert reached.wait(300), f"{rid} never reported denoising progress: {cluster.describe()}"
    return j, pending


def test_cancel_mid_denoise_frees_everything(cluster, model):
    _, family = model
    _, pending = start_long(cluster, family, "cancel-1")
    assert cluster.describe()["requests"] == {"denoising": 1}
    assert cluster.call(cluster.backend.cancel("cancel-1")) is True
    with pytest.raises(Cancelled):
        pending.result(60)
    desc = cluster.wait_until(nothing_held, "slots, held tensors and engine state freed after cancel")
    assert desc["stats"]["cancelled"] == 1
    assert cluster.call(cluster.backend.cancel("cancel-1")) is False


def test_killed_denoiser_request_completes_on_the_other(cluster, model):
    _, family = model
    j, pending = start_long(cluster, family, "kill-1", seed=4)
    victim = holder_of(cluster.describe(), "kill-1", "denoiser")
    cluster.on_loop(cluster.backend.kill, victim)
    data = pending.result(600)
    frames, _ = run_request(family, j.params, request_id=j.request_id)
    assert data == encode_frames(frames.to_uint8(), "png")  # the retry is the same seeded computation
    desc = cluster.wait_until(nothing_held, "nothing leaked after the retry")
    assert victim not in {i["id"] for i in desc["instances"]}
    assert desc["stats"]["retries"] == 1 and desc["stats"]["instances_lost"] == 1


def test_killing_the_last_denoiser_fails_with_a_clear_error(cluster, model):
    _, family = model
    _, pending = start_long(cluster, family, "kill-2", seed=6)
    victim = holder_of(cluster.describe(), "kill-2", "denoiser")
    cluster.on_loop(cluster.backend.kill, victim)
    with pytest.raises(StageFailed, match="no other denoiser instance is registered"):
        pending.result(120)
    desc = cluster.wait_until(nothing_held, "nothing leaked after the failure")
    assert [i["role"] for i in desc["instances"]] == ["decoder", "encoder"]
