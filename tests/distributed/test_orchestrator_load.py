"""1 encoder : 2 denoisers : 1 decoder under 16 concurrent requests."""

from __future__ import annotations

import dataclasses
import io

import pytest
from orchestrator_support import FAST_HEARTBEATS, Cluster, job, nothing_held
from PIL import Image

from triptych.deploy.launch import TopologyConfig
from triptych.families.registry import load_family, make_tiny


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = make_tiny("flux", tmp_path_factory.mktemp("orch-load") / "flux")
    return path, load_family(path, roles=())


@pytest.mark.parametrize("dispatch", ["round_robin", "max_free_slots"])
def test_sixteen_concurrent_requests_all_complete_on_both_denoisers(model, dispatch):
    path, family = model
    config = dataclasses.replace(FAST_HEARTBEATS, dispatch=dispatch)
    cluster = Cluster(path, TopologyConfig(encoders=1, denoisers=2, decoders=1, transfer="zmq", capacity=3), config)
    try:
        jobs = [job(family, f"load-{n}", seed=n) for n in range(16)]
        pending = [cluster.submit(j) for j in jobs]
        outputs = [p.result(600) for p in pending]
        for data, j in zip(outputs, jobs):
            image = Image.open(io.BytesIO(data))
            assert image.format == "PNG" and image.size == (j.params.width, j.params.height)
        desc = cluster.wait_until(nothing_held, "every slot pool back to full capacity")
        denoisers = [i for i in desc["instances"] if i["role"] == "denoiser"]
        assert len(denoisers) == 2 and all(d["assigned"] > 0 for d in denoisers)
        assert sum(d["assigned"] for d in denoisers) == 16
        assert desc["stats"]["done"] == 16
        assert not {"failed", "retries", "dropped_stale", "malformed"} & set(desc["stats"])
    finally:
        cluster.close()
