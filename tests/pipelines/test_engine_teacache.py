"""TeaCache attached to the engine, generate and the head's validation (calibrate → use → release)."""

from __future__ import annotations

import pytest

from triptych.calibration.metrics import psnr
from triptych.core.errors import InvalidParam
from triptych.engine import DenoiserEngine, EngineConfig
from triptych.engine.runner import run_request
from triptych.engine.teacache import make_teacache
from triptych.families.base import GenerationParams
from triptych.families.registry import load_family, make_tiny
from triptych.families.teacache_check import check_teacache

STEPS = 8
MIN_PSNR_DB = 31.0  # TeaCache 0.3 is an approximation: measured 50.8 dB vs the uncached output (two runs)


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    """A tiny FLUX with a TeaCache profile fitted by the CLI, as a user would."""
    from triptych.cli import main

    model = make_tiny("flux", tmp_path_factory.mktemp("flux-tc"), seed=0)
    args = ["calibrate", "--model", str(model), "--steps", str(STEPS), "--thresholds", "0.2", "--eval-images", "2"]
    args += ["--out", f"{model}/teacache/flux-{STEPS}steps.json"]  # beside the model, as a shipped one
    assert main(args) == 0
    return load_family(model)


def test_no_profile_is_refused_at_the_head_and_in_the_engine(tiny_model_dir):
    family = load_family(tiny_model_dir("flux"))
    p = family.resolve(GenerationParams(prompt="x", teacache_threshold=0.2))
    with pytest.raises(InvalidParam) as err:
        check_teacache(family, p)
    assert err.value.field == "teacache_threshold" and "not calibrated" in err.value.rule
    engine = DenoiserEngine(family, accel=make_teacache(family))
    with pytest.raises(InvalidParam):
        engine.add(family.prepare("r", p, family.encode(p)))
    assert not engine.has_work()


def test_engine_teacache_three_way_and_release(calibrated):
    family = calibrated
    base = family.resolve(GenerationParams(prompt="a red circle", seed=3, steps=STEPS))
    check_teacache(family, base.replace(teacache_threshold=0.3))  # profile found: accepted

    def run(threshold):
        engine = DenoiserEngine(family, EngineConfig(), accel=make_teacache(family))
        p = base.replace(teacache_threshold=threshold)
        engine.add(family.prepare("r", p, family.encode(p)))
        out = engine.run_until_done()[0]
        assert engine.accel.num_states() == 0 and engine.accel.active_requests() == []  # released
        return out, engine.stats

    off, off_stats = run(0.0)
    on, on_stats = run(0.3)
    again, _ = run(0.0)
    assert (again.latents == off.latents).all()
    assert on_stats.skipped_rows > 0 and off_stats.skipped_rows == 0
    assert psnr(family.decode(on.latents, base).array, family.decode(off.latents, base).array) >= MIN_PSNR_DB


def test_generate_cli_with_teacache(calibrated, tmp_path):
    from triptych.cli import main

    model = str(calibrated.model_dir)
    out = tmp_path / "a.png"
    assert (
        main(
            [
                "generate",
                "--model",
                model,
                "--prompt",
                "a red circle",
                "--steps",
                str(STEPS),
                "--teacache-threshold",
                "0.3",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    assert out.stat().st_size > 0
    # Same request at a step count without a profile: one clear line, exit code 2.
    assert (
        main(
            [
                "generate",
                "--model",
                model,
                "--prompt",
                "x",
                "--steps",
                "5",
                "--teacache-threshold",
                "0.3",
                "--out",
                str(out),
            ]
        )
        == 2
    )


def test_run_request_accel_matches_engine(calibrated):
    family = calibrated
    p = family.resolve(GenerationParams(prompt="a blue square", seed=4, steps=STEPS, teacache_threshold=0.3))
    accel = make_teacache(family)
    frames, _ = run_request(family, p, accel=accel)
    engine = DenoiserEngine(family, accel=make_teacache(family))
    engine.add(family.prepare("r", p, family.encode(p)))
    state = engine.run_until_done()[0]
    assert (family.decode(state.latents, p).array == frames.array).all()
    assert accel.num_states() == 0


def test_rest_teacache_request_and_refusals(calibrated, tmp_path):
    import httpx

    from tests.e2e.http_support import serve
    from triptych.control.backend import InProcessBackend
    from triptych.head.app import HeadConfig, create_app

    app = create_app(InProcessBackend(calibrated), HeadConfig(data_dir=tmp_path / "data"))
    with serve(app) as base:
        url = f"{base}/v1/images/generations"
        body = {
            "prompt": "a red circle",
            "size": "64x64",
            "seed": 1,
            "num_inference_steps": STEPS,
            "response_format": "b64_json",
        }
        ok = httpx.post(url, json={**body, "teacache_threshold": 0.3}, timeout=120)
        assert ok.status_code == 200, ok.text
        for bad in ({"teacache_threshold": 0.3, "num_inference_steps": 5}, {"teacache_threshold": 5.0}):
            resp = httpx.post(url, json={**body, **bad}, timeout=120)
            assert resp.status_code == 400, resp.text
            err = resp.json()["error"]
            assert err["param"] == "teacache_threshold", err
