"""TeaCache on a served 2-rank denoiser (CFG parallel on gloo, tiny Qwen-Image with a profile fitted
here): a TeaCache request's image equals the single-rank TeaCache run within the parallel pixel
bound, and the instance skipped exactly as many rows as the single rank did (the engine's skip
counter, reported by the worker, read from the head's Prometheus registry). That every rank makes
the same decisions, equal to a single rank's, is tested row by row in test_parallel_teacache.py."""

from __future__ import annotations

import io

import numpy as np
import pytest
from orchestrator_support import Cluster, nothing_held
from PIL import Image

from triptych.control.backend import GenerationJob
from triptych.deploy.launch import TopologyConfig
from triptych.engine.runner import run_request
from triptych.engine.teacache import make_teacache
from triptych.families.base import GenerationParams
from triptych.families.registry import load_family, make_tiny
from triptych.parallel import ParallelConfig

STEPS = 8
# As in test_parallel_served.py: CFG parallel changes batch composition (latents differ by ~1e-6),
# which after the VAE and uint8 rounding moved pixels by at most 1 of 255 there; measured here: 1.
MAX_PIXEL_DIFF = 2
SKIPPED = "triptych_denoiser_skipped_steps_total"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from triptych.calibration.fit import calibrate

    path = make_tiny("qwen-image", tmp_path_factory.mktemp("served-teacache") / "qwen-image")
    family = load_family(path)
    calibrate(path, STEPS, prompts=("a red fox", "a lighthouse"), seeds=(0, 1), family=family, guidance=4.0)
    return path, family


@pytest.fixture(scope="module")
def cluster(model):
    topology = TopologyConfig(transfer="zmq", capacity=4, parallel=ParallelConfig(cfg=2))
    c = Cluster(model[0], topology)
    yield c
    c.close()


def params(family, seed: int, threshold: float) -> GenerationParams:
    p = GenerationParams(
        "a red circle on blue",
        negative_prompt="noise",
        guidance=4.0,
        seed=seed,
        steps=STEPS,
        teacache_threshold=threshold,
    )
    return family.resolve(p)


def test_teacache_on_the_instance_skips_as_one_rank_does(cluster, model):
    _, family = model
    p = params(family, seed=3, threshold=0.3)
    cache = make_teacache(family)
    frames, _ = run_request(family, p, request_id="tc-alone", accel=cache)
    expected = frames.to_uint8()[0].astype(np.int16)
    skipped_alone = cache.stats.rows_skipped
    assert 0 < skipped_alone < 2 * STEPS, f"{skipped_alone} rows skipped alone: the comparison would be vacuous"

    registry = cluster.backend.metrics.registry
    before = registry.get_sample_value(SKIPPED) or 0.0
    data = cluster.submit(GenerationJob("tc-served", p, "png")).result(300)
    got = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"), dtype=np.int16)
    assert np.abs(got - expected).max() <= MAX_PIXEL_DIFF
    # the worker reports its engine counters with its heartbeats: wait for the window holding the run
    cluster.wait_until(lambda d: (registry.get_sample_value(SKIPPED) or 0.0) - before >= skipped_alone, "skip count")
    assert (registry.get_sample_value(SKIPPED) or 0.0) - before == skipped_alone
    cluster.wait_until(nothing_held, "nothing held")
