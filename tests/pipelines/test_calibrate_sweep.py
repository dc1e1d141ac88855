"""``triptych calibrate`` sweeps and recommends; ``auto`` means the recommendation (tiny FLUX, 6 steps;
the target is set where this random-weight model's thresholds differ, its images being near-flat)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from triptych import cli
from triptych.accel.teacache_profile import AUTO_THRESHOLD, find_profile, load_profile
from triptych.calibration.fit import calibrate
from triptych.calibration.quality import quality_report
from triptych.calibration.sweep import Target
from triptych.core.errors import InvalidParam
from triptych.families.registry import load_family, make_tiny

STEPS = 6
FIT_PROMPTS = ("a red fox in the snow", "a lighthouse at night")
TARGET = Target(min_psnr=50.0, min_ssim=0.9, max_adherence_drop=0.02)


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    root = tmp_path_factory.mktemp("calibrate")
    model = make_tiny("flux", root / "flux", seed=0)
    profile, path = calibrate(
        model,
        STEPS,
        prompts=FIT_PROMPTS,
        family=load_family(model),
        thresholds=(0.05, 0.1, 1.0),
        eval_images=2,
        target=TARGET,
        report_dir=root / "report",
    )
    return model, profile, path, root


def test_the_profile_holds_the_sweep_and_recommends_the_largest_saving_that_meets_the_target(calibrated):
    model, profile, path, _ = calibrated
    loaded = load_profile(path)
    assert loaded.recommended_threshold == profile.recommended_threshold is not None
    rows = loaded.sweep["rows"]
    assert [r["threshold"] for r in rows] == [0.0, 0.05, 0.1, 1.0]
    for r in rows[1:]:  # every row's verdict is the target's
        meets = r["psnr_min"] >= TARGET.min_psnr and r["ssim_min"] >= TARGET.min_ssim
        assert meets == (not r["failures"]), r
    meeting = [r for r in rows[1:] if not r["failures"] and r["skipped_fraction"] > 0]
    best = max(r["skipped_fraction"] for r in meeting)
    chosen = rows[loaded.sweep["recommended_row"]]
    assert chosen["threshold"] == loaded.recommended_threshold and chosen["skipped_fraction"] == best
    assert any(r["failures"] for r in rows[1:]), "the sweep should reach a threshold that misses the target"
    assert loaded.target == {"min_psnr": 50.0, "min_ssim": 0.9, "max_adherence_drop": 0.02, "min_motion_agreement": 1.0}


def test_evaluation_requests_are_unseen_by_the_fit_and_both_branch_fits_are_reported(calibrated):
    _, profile, _, root = calibrated
    assert not set(profile.sweep["prompts"]) & set(profile.quality["prompts"])
    assert not set(profile.sweep["seeds"]) & set(profile.quality["seeds"])
    per = profile.quality["per_branch"]
    assert set(per) == set(profile.quality["branches"]) and all(
        0 <= f["joint_r2"] <= f["own_r2"] + 1e-9 for f in per.values()
    )
    html = (root / "report" / "index.html").read_text()
    assert "img/fit.png" in html and "img/speed_quality.png" in html and "plain_0.png" in html


def test_auto_resolves_to_the_recommendation(calibrated, capsys):
    model, profile, _, _ = calibrated
    report = quality_report(model, [AUTO_THRESHOLD, profile.recommended_threshold], images=2, steps=STEPS, world=False)
    auto, explicit = report["settings"]
    assert auto["auto"] and not explicit["auto"] and auto["teacache_threshold"] == profile.recommended_threshold
    assert auto["skipped_fraction"] == explicit["skipped_fraction"] > 0 and auto["psnr_min"] == explicit["psnr_min"]
    args = ["quality", "--model", str(model), "--teacache-threshold", "auto", "--images", "2", "--steps", str(STEPS)]
    assert cli.main(args + ["--min-psnr", "1", "--min-ssim", "0"]) == 0
    assert f"| auto ({profile.recommended_threshold:g}) |" in capsys.readouterr().out
    assert cli.main(args + ["--min-psnr", "1000"]) == 1  # the gates are on


def test_a_profile_without_a_recommendation_refuses_auto_with_one_line(tmp_path, capsys):
    model = make_tiny("flux", tmp_path / "flux", seed=1)
    profile, _ = calibrate(model, STEPS, prompts=FIT_PROMPTS, seeds=(0,), family=load_family(model), thresholds=())
    assert profile.recommended_threshold is None and find_profile(model, STEPS, "flux") is not None
    with pytest.raises(InvalidParam, match="teacache_threshold"):
        quality_report(model, [AUTO_THRESHOLD], images=1, steps=STEPS, world=False)
    code = cli.main(["quality", "--model", str(model), "--teacache-threshold", "auto", "--steps", str(STEPS)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith("error: invalid teacache_threshold='auto'")


def _cli_json(args: list[str], report: Path) -> tuple[int, dict]:
    code = cli.main(args + ["--report", str(report)])
    return code, json.loads((report / "report.json").read_text())


def test_a_baseline_gates_10x_the_recommendation_at_the_calibrated_target(calibrated):
    model, profile, _, root = calibrated
    matrix = root / "matrix.yaml"
    matrix.write_text(f"steps: [{STEPS}]\nprompts: [a red fox in the snow, a lighthouse at night]\nguidance: [3.5]\n")
    base = ["quality", "--model", str(model), "--baseline", str(root / "base")]
    assert (
        cli.main(["quality", "--model", str(model), "--save-baseline", str(root / "base"), "--matrix", str(matrix)])
        == 0
    )
    code, same = _cli_json(base, root / "same")
    assert code == 0 and same["kind"] == "exact" and same["summary"]["identical"] == 2
    code, auto = _cli_json(base + ["--teacache-threshold", "auto"], root / "auto")
    conf = auto["current"]["configuration"]
    assert conf["teacache_requested"] == "auto" and conf["teacache_threshold"] == profile.recommended_threshold
    # held to the calibrated target, not the defaults (plus the video frame-consistency gate)
    assert {k: v for k, v in auto["gates"].items() if k != "max_temporal_drop"} == profile.target
    damaging = 10 * profile.recommended_threshold
    code, bad = _cli_json(base + ["--teacache-threshold", f"{damaging:g}"], root / "damaged")
    assert code == 1 and bad["failures"] and bad["failures"][0].startswith("worst PSNR")
    assert bad["summary"]["skipped_fraction"] > auto["summary"]["skipped_fraction"]
    assert "Gates FAILED" in (root / "damaged" / "index.html").read_text()


def _tree_hashes(directory: Path) -> dict[str, str]:
    import hashlib

    files = [p for p in directory.rglob("*") if p.is_file()]
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def test_the_cli_writes_the_user_directory_and_auto_reports_the_profile_it_used(tmp_path, monkeypatch, capsys):
    """``triptych calibrate`` writes ``$XDG_DATA_HOME/triptych/teacache/<model identity>/``, never the
    model's (or the package's) ``teacache/``; ``generate --teacache-threshold auto`` finds it there
    first and names it; the shipped profiles stay byte-identical."""
    from triptych.accel.teacache_profile import PACKAGE_DIR
    from triptych.cli.profiles import user_profiles_dir

    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    shipped = _tree_hashes(PACKAGE_DIR / "assets")
    model = make_tiny("flux", tmp_path / "flux", seed=0)
    args = ["calibrate", "--model", str(model), "--steps", str(STEPS), "--seeds", "0", "--eval-images", "2"]
    sweep = ["--thresholds", "1.0", "--warmup", "1", "--max-skips", "0", "--min-psnr", "0", "--min-ssim", "0"]
    assert cli.main(args + sweep) == 0  # the target anything meets: 1.0 (it skips) is recommended
    written = user_profiles_dir(model) / f"flux-{STEPS}steps.json"
    assert written.is_relative_to(tmp_path / "data" / "triptych" / "teacache")
    assert f"wrote {written}" in capsys.readouterr().out
    assert load_profile(written).recommended_threshold == 1.0 and not (Path(model) / "teacache").exists()
    out = tmp_path / "a.png"
    gen = ["generate", "--model", str(model), "--prompt", "x", "--steps", str(STEPS), "--out", str(out)]
    assert cli.main(gen + ["--teacache-threshold", "auto"]) == 0
    assert f"teacache auto: threshold 1 from profile {written}" in capsys.readouterr().out
    assert _tree_hashes(PACKAGE_DIR / "assets") == shipped


def test_the_recommended_forecast_becomes_the_profiles(tmp_path, capsys):
    """``--forecast`` is swept like ``--warmup``; the recommended row's forecast is the profile's."""
    model = make_tiny("flux", tmp_path / "flux", seed=0)
    out = tmp_path / "p.json"
    args = ["calibrate", "--model", str(model), "--steps", str(STEPS), "--seeds", "0", "--eval-images", "2"]
    args += ["--thresholds", "1.0", "--warmup", "2", "--max-skips", "0", "--out", str(out)]
    assert cli.main(args + ["--forecast", "2"]) == 2 and "forecast" in capsys.readouterr().err
    assert cli.main(args + ["--forecast", "1", "--min-psnr", "0", "--min-ssim", "0"]) == 0
    loaded = load_profile(out)
    assert [r["forecast"] for r in loaded.sweep["rows"]] == [0, 1]
    assert (loaded.recommended_threshold, loaded.forecast) == (1.0, 1)
    assert "forecast 1)" in capsys.readouterr().out


def test_calibrate_warns_when_the_evaluation_set_is_too_small_for_the_target(tmp_path, monkeypatch, capsys):
    """Adherence is judged as a share of the images: at 2 points allowed, fewer than 50 images make one
    image's change a failure. A shape-world model (``"world": "shapes"``) gets the warning before the
    sweep starts (the sweep itself is stubbed here: a world-model sweep took 76 s on this machine)."""

    class Swept(Exception):
        pass

    def stub(*args, **kwargs):
        raise Swept(kwargs["eval_images"])

    monkeypatch.setattr("triptych.calibration.fit.calibrate", stub)
    model = make_tiny("flux", tmp_path / "flux", seed=0)
    (Path(model) / "triptych.json").write_text(json.dumps({"world": "shapes"}))
    args = ["calibrate", "--model", str(model), "--steps", str(STEPS), "--thresholds", "0.1"]
    for images, warned in (("2", True), ("50", False)):
        with pytest.raises(Swept):
            cli.main(args + ["--eval-images", images])
        err = capsys.readouterr().err
        assert ("needs at least 50 images" in err) == warned, err
        assert (f"warning: --eval-images {images} is too few for the target" in err) == warned
    assert (
        Target(max_adherence_drop=0.05).images_needed() == 20 and Target(max_adherence_drop=0).images_needed() is None
    )


def test_calibrate_refuses_an_out_inside_the_installed_package(capsys):
    from triptych.accel.teacache_profile import PACKAGE_DIR, ProfileError, TeaCacheProfile, save_profile

    target = PACKAGE_DIR / "assets" / "default" / "teacache" / "qwen-image-20steps.json"
    before = target.read_bytes()
    assert cli.main(["calibrate", "--steps", "20", "--out", str(target)]) == 2
    assert "inside the installed package" in capsys.readouterr().err
    with pytest.raises(ProfileError, match="inside the installed package"):
        save_profile(TeaCacheProfile("qwen-image", "m", 20, (0, 0, 0, 1, 0)), target)
    assert target.read_bytes() == before
