"""``triptych quality``: plain vs accelerated on the same requests, with fidelity, skipped work,
adherence and gates that can fail (a tiny FLUX with a profile fitted here; the packaged default
model for the shape-world adherence figures)."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from triptych import cli
from triptych.calibration.fit import calibrate
from triptych.calibration.quality import quality_report
from triptych.core.errors import InvalidParam
from triptych.families.registry import load_family, make_tiny

STEPS = 8
MIN_PSNR_AT_05 = 29.0  # worst PSNR of 3 requests at threshold 0.5: measured 48.4 dB (two runs)


@pytest.fixture(scope="module")
def flux(tmp_path_factory):
    model = make_tiny("flux", tmp_path_factory.mktemp("quality") / "flux", seed=0)
    calibrate(
        model,
        STEPS,
        prompts=("a red fox in the snow", "a lighthouse at night"),
        seeds=(0, 1),
        family=load_family(model),
    )
    return model


def test_a_threshold_that_skips_nothing_is_identical_and_a_large_one_is_measured(flux):
    """The PSNR gate is set, and passes; set between the two settings' worst PSNRs it fails only the
    setting below it (the figures come from the first report: the runs are deterministic)."""
    report = quality_report(flux, [1e-9, 0.5], images=3, steps=STEPS, world=False, min_psnr=MIN_PSNR_AT_05)
    none, large = report["settings"]
    assert (none["skipped_fraction"], none["identical"], none["psnr_min"], none["ssim_min"]) == (0.0, 3, math.inf, 1.0)
    assert large["skipped_fraction"] > 0 and large["identical"] < 3
    assert 0 < large["psnr_min"] <= large["psnr_mean"] < math.inf and 0 < large["ssim_min"] < 1
    assert none["adherence"] is None and report["world"] is False
    assert report["passed"] and none["failures"] == large["failures"] == []
    strict = quality_report(flux, [1e-9, 0.5], images=3, steps=STEPS, world=False, min_psnr=large["psnr_min"] + 0.01)
    assert not strict["passed"] and strict["settings"][0]["failures"] == []
    assert "worst PSNR" in strict["settings"][1]["failures"][0]


def test_gates_fail_the_report_and_the_cli_exits_1(flux, tmp_path, capsys):
    report = quality_report(flux, [0.5], images=2, steps=STEPS, world=False, min_psnr=1000.0)
    assert not report["passed"] and "worst PSNR" in report["settings"][0]["failures"][0]
    out = tmp_path / "q.json"
    code = cli.main(
        [
            "quality",
            "--model",
            str(flux),
            "--teacache-threshold",
            "0.5",
            "--images",
            "2",
            "--steps",
            str(STEPS),
            "--min-psnr",
            "1000",
            "--out",
            str(out),
        ]
    )
    assert code == 1 and json.loads(out.read_text())["passed"] is False
    assert "| 0.5 |" in capsys.readouterr().out
    assert (
        cli.main(
            [
                "quality",
                "--model",
                str(flux),
                "--teacache-threshold",
                "0.5",
                "--images",
                "2",
                "--steps",
                str(STEPS),
                "--min-psnr",
                "1",
            ]
        )
        == 0
    )


def test_bad_input_names_the_field(flux):
    with pytest.raises(InvalidParam, match="teacache_threshold"):
        quality_report(flux, [0.0], images=1, steps=STEPS)
    with pytest.raises(InvalidParam, match="images"):
        quality_report(flux, [0.1], images=0, steps=STEPS)
    with pytest.raises(InvalidParam, match="teacache_threshold"):  # no profile for 3 steps
        quality_report(flux, [0.1], images=1, steps=3)


def test_the_cli_pages_quality_line_runs_on_the_default_model(capsys, tmp_path, monkeypatch):
    """docs/cli.md: ``triptych quality --teacache-threshold auto 0.1`` (with ``--images 2`` to keep it short;
    1.7 s in-process on the loaded 2-core machine). The shipped profile recommends a threshold (forecast 1,
    warmup 6, cap 1), so ``auto`` runs as that threshold, naming the profile, and 0.1 is measured; the exit
    is the gates' (0 or 1). A user profile without a recommendation comes first and lists auto as not run."""
    from triptych.accel.teacache_profile import load_profile, save_profile
    from triptych.cli.profiles import user_profiles_dir
    from triptych.families.models import PACKAGED_DEFAULT

    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    argv = ["quality", "--teacache-threshold", "auto", "0.1", "--images", "2"]
    code = cli.main(argv)
    out = capsys.readouterr().out
    profile = PACKAGED_DEFAULT / "teacache" / "qwen-image-20steps.json"
    recommended = load_profile(profile).recommended_threshold
    assert code in (0, 1) and recommended is not None
    assert f"| auto ({recommended:g}) |" in out and f"auto = {recommended:g} from profile {profile}" in out
    assert "\n| 0.1 |" in out

    mine = user_profiles_dir(PACKAGED_DEFAULT) / profile.name
    save_profile(dataclasses.replace(load_profile(profile), recommended_threshold=None), mine)
    assert cli.main(argv) in (0, 1)
    out = capsys.readouterr().out
    assert f"| auto | not run: auto: no recommended threshold in profile {mine} |" in out
    assert "\n| 0.1 |" in out
