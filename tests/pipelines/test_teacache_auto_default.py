"""README: ``teacache_threshold: "auto"`` on the built-in default model skips 35% of the transformer
work. One request through the shipped profile (forecast 1, warmup 6, cap 1): the share of rows skipped,
and its image against the plain path's at the calibration target's PSNR (the profile met it on 50
images; benchmarks/RESULTS.md, "TeaCache with a forecast residual"). Measured: 35.0% skipped (7 of 20
steps per branch), 97.8 dB from plain; 6 s."""

from __future__ import annotations

from triptych.accel.teacache_profile import AUTO_THRESHOLD
from triptych.calibration.metrics import psnr
from triptych.calibration.target import Target
from triptych.engine.runner import run_request
from triptych.engine.teacache import make_teacache
from triptych.families.base import GenerationParams
from triptych.families.models import default_model_dir
from triptych.families.registry import load_family


def test_auto_on_the_default_model_skips_35_percent_at_the_target():
    family = load_family(default_model_dir())
    plain = family.resolve(GenerationParams(prompt="a red circle on a blue background", seed=7))
    want, _ = run_request(family, plain)
    accel = make_teacache(family)
    got, _ = run_request(
        family, family.resolve(GenerationParams(**{**vars(plain), "teacache_threshold": AUTO_THRESHOLD})), accel=accel
    )
    stats = accel.stats
    share = stats.rows_skipped / (stats.rows_skipped + stats.rows_computed)
    db = psnr(got.array, want.array, data_range=255.0)
    print(f"auto: {share:.1%} of rows skipped, {db:.1f} dB from plain")
    assert share >= 0.35
    assert db >= Target().min_psnr
