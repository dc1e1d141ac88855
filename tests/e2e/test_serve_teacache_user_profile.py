"""Slow (``--run-slow``): a bare ``serve`` (its head config, local worker processes) runs
``teacache_threshold: "auto"`` from the profile ``triptych calibrate`` wrote to the user directory
(``$XDG_DATA_HOME``: a temp dir, tests/conftest.py), skipping steps in the denoiser worker."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.e2e.http_support import serve
from triptych import cli
from triptych.cli.profiles import user_profiles_dir
from triptych.families.registry import make_tiny

pytestmark = pytest.mark.slow
STEPS = 4


def skipped_steps(base: str) -> float:
    lines = httpx.get(f"{base}/metrics").text.splitlines()
    return sum(float(x.split()[-1]) for x in lines if x.startswith("triptych_denoiser_skipped_steps_total"))


def test_serve_runs_auto_from_the_user_profile(tmp_path):
    from triptych.control.orchestrator import OrchestratorConfig
    from triptych.deploy.launch import EmbeddedBackend
    from triptych.head.app import create_app

    model = make_tiny("flux", tmp_path / "flux", seed=0)
    args = ["calibrate", "--model", str(model), "--steps", str(STEPS), "--seeds", "0", "--eval-images", "2"]
    args += ["--thresholds", "1.0", "--warmup", "1", "--max-skips", "0", "--min-psnr", "0", "--min-ssim", "0"]
    assert cli.main(args) == 0  # a target anything meets: 1.0 recommended, written to the user directory
    assert (user_profiles_dir(model) / f"flux-{STEPS}steps.json").is_file()
    serve_args = cli.build_parser().parse_args(["serve"])
    head_config = serve_args.serve_flags.head_config(serve_args, tmp_path / "data")
    backend = EmbeddedBackend(model, OrchestratorConfig(host="127.0.0.1", control_port=0))
    with serve(create_app(backend, head_config)) as base:
        body = {"prompt": "a red cube", "seed": 3, "num_inference_steps": STEPS, "teacache_threshold": "auto"}
        resp = httpx.post(f"{base}/v1/images/generations", json=body, timeout=120)
        assert resp.status_code == 200, resp.text
        deadline = time.monotonic() + 30  # the worker's engine stats reach the head's metrics periodically
        while skipped_steps(base) == 0 and time.monotonic() < deadline:
            time.sleep(0.2)
        # threshold 1.0 with warmup 1 and cooldown 1: steps 1 and 2 of 4 skip, one row each (no CFG)
        assert skipped_steps(base) == 2
