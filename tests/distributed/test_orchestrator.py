"""The disaggregated path gives exactly the single-process result; late workers join and get work."""

from __future__ import annotations

import io
from dataclasses import replace

import numpy as np
import pytest
from orchestrator_support import FAST_HEARTBEATS, Cluster, job, nothing_held
from PIL import Image

from tests.helpers import NEEDS_MOONCAKE
from triptych.core.media import encode_frames
from triptych.deploy.launch import TopologyConfig
from triptych.engine.runner import run_request
from triptych.families.registry import load_family, make_tiny


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = make_tiny("flux", tmp_path_factory.mktemp("orch") / "flux")
    return path, load_family(path)


def reference(family, j) -> tuple[np.ndarray, bytes]:
    frames, _ = run_request(family, j.params, request_id=j.request_id)
    return frames.to_uint8(), encode_frames(frames.to_uint8(), j.output_format, quality=j.quality)


def decoded(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))[None]


@pytest.mark.parametrize(
    "transfer",
    ["zmq", pytest.param("mooncake", marks=NEEDS_MOONCAKE)],
)
def test_bit_identical_to_single_process(model, transfer):
    path, family = model
    cluster = Cluster(path, TopologyConfig(transfer=transfer, capacity=2))
    try:
        assert {i["transfer"] for i in cluster.describe()["instances"]} == {transfer}
        jobs = [job(family, f"exact-{seed}", seed=seed) for seed in (0, 5)]
        for j in jobs:  # one at a time: the same batch composition as the single-process run
            data = cluster.submit(j).result(300)
            ref_pixels, ref_bytes = reference(family, j)
            assert np.array_equal(decoded(data), ref_pixels)
            assert data == ref_bytes
        lossy = replace(job(family, "exact-webp", seed=5, fmt="webp"), quality=30)  # the decoder gets the quality
        default_quality = reference(family, replace(lossy, quality=None))[1]
        assert cluster.submit(lossy).result(300) == reference(family, lossy)[1] != default_quality
        cluster.wait_until(nothing_held, "every slot back after the requests")
    finally:
        cluster.close()


def test_worker_started_after_the_head_registers_and_gets_work(model):
    """NOTE: the head fails requests fast once a role has had no instance for ``unavailable_after_s``
    (30 s), counted from the head's start; on a loaded machine starting the other workers took
    longer than that and the queued request failed before the late denoiser came. That grace is not
    what this test is about: it is set beyond the test's own bounds."""
    path, family = model
    config = replace(FAST_HEARTBEATS, unavailable_after_s=600.0)
    cluster = Cluster(path, TopologyConfig(encoders=1, denoisers=0, decoders=1, transfer="zmq"), config)
    try:
        j = job(family, "late-1", seed=2)
        pending = cluster.submit(j)
        cluster.wait_until(lambda d: d["requests"] == {"queued": 1}, "request queued without a denoiser")
        late = cluster.on_loop(cluster.backend.spawn, "denoiser")
        data = pending.result(300)
        assert data == reference(family, j)[1]
        desc = cluster.wait_until(nothing_held, "every slot back")
        (den,) = [i for i in desc["instances"] if i["role"] == "denoiser"]
        assert den["id"] == late and den["assigned"] == 1
    finally:
        cluster.close()


def test_a_second_worker_process_with_a_taken_instance_id_exits_at_once(model):
    """A real ``triptych worker`` reusing a registered instance id is refused and exits with code 3
    well within its 120 s registration timeout (it used to wait it out silently: both processes had
    the same ZMQ identity, so the refusal went to the first one)."""
    import os
    import subprocess
    import sys

    path, _ = model
    cluster = Cluster(path, TopologyConfig(encoders=0, denoisers=0, decoders=1, transfer="zmq"))
    try:
        head = cluster.backend.orchestrator
        cmd = [sys.executable, "-m", "triptych.cli", "worker", "--role", "decoder", "--head", head.control_address]
        cmd += ["--model", str(path), "--instance-id", "decoder-0", "--transfer", "zmq"]
        env = {**os.environ, "TRIPTYCH_TOKEN": head.token, "HF_HUB_OFFLINE": "1"}
        proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL)
        try:
            assert proc.wait(timeout=90) == 3
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert [i["id"] for i in cluster.describe()["instances"]] == ["decoder-0"]
    finally:
        cluster.close()
