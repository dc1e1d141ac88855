"""``--autoscale denoiser=1:2`` on the local supervisor (tiny FLUX, 1 encoder, 1 decoder, capacity 1
per worker so requests queue): under a burst the denoiser pool grows to 2, and after the burst it
drains one instance and stops it while requests keep arriving; every request succeeds with the
image ``run_request`` gives (within the batching tolerance of ``tests/e2e/test_server_batching.py``).
Waits are liveness bounds, not speed checks; the speed is ``benchmarks/autoscale.py``'s."""

from __future__ import annotations

import numpy as np
import pytest
from orchestrator_support import Cluster, job

from triptych.deploy.config import AutoscaleConfig
from triptych.deploy.launch import TopologyConfig
from triptych.engine.runner import run_request
from triptych.families.registry import load_family

STEPS = 12
MAX_DIFF = 2  # uint8 levels (tests/e2e/test_server_batching.py)
SCALE = AutoscaleConfig(pools=("denoiser=1:2",), up_queue=2, up_wait_s=1.0, down_idle_s=2.0, interval_s=0.2)


@pytest.fixture(scope="module")
def cluster(tiny_model_dir):
    model = tiny_model_dir("flux")
    c = Cluster(model, TopologyConfig(transfer="zmq", capacity=1, torch_threads=1), autoscale=SCALE)
    yield c, load_family(model)
    c.close()


def pixels(data: bytes) -> np.ndarray:
    import io

    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"), dtype=np.int16)


def check(family, j, data: bytes) -> None:
    want = run_request(family, j.params, request_id=j.request_id)[0].to_uint8()[0].astype(np.int16)
    assert np.abs(pixels(data) - want).max() <= MAX_DIFF


def denoisers(desc: dict) -> list[str]:
    return sorted(i["id"] for i in desc["instances"] if i["role"] == "denoiser")


def test_grows_under_a_burst_then_drains_without_dropping(cluster):
    c, family = cluster
    burst = [job(family, f"burst-{i}", seed=i, steps=STEPS) for i in range(8)]
    futures = [c.submit(j) for j in burst]
    c.wait_until(lambda d: len(denoisers(d)) == 2, "a second denoiser registered", timeout=120)
    for j, f in zip(burst, futures):
        check(family, j, f.result(300))
    # After the burst: one request at a time keeps coming while the idle instance is drained and stopped.
    trickle, n = [], 0
    while len(denoisers(c.describe())) == 2 or not any(e[2] == "stop" for e in c.backend.autoscaler.events):
        j = job(family, f"trickle-{n}", seed=100 + n, steps=2)
        trickle.append((j, c.submit(j).result(120)))
        n += 1
        assert n < 200, "the pool never shrank"
    (stopped,) = [e[3] for e in c.backend.autoscaler.events if e[2] == "stop"]
    c.wait_until(lambda d: len(denoisers(d)) == 1 and stopped not in denoisers(d), "back to one denoiser", 60)
    for j, data in trickle:
        check(family, j, data)
    kinds = [e[2] for e in c.backend.autoscaler.events]
    assert kinds == ["add", "drain", "stop"], c.backend.autoscaler.events
    stats = c.describe()["stats"]
    assert stats.get("failed", 0) == 0 and stats.get("retries", 0) == 0 and stats["done"] == len(burst) + n
    gone = c.wait_until(lambda d: not d["local_workers"]["workers"][stopped]["running"], f"{stopped} exited")
    assert gone["local_workers"]["workers"][stopped]["retired"]
