"""``triptych calibrate`` on a moving-shape-world video model, and ``auto`` on the packaged one.

A tiny random Wan 2.1 told it draws the moving shape world (``"world": "shapes-video"``) runs the
whole command: fit on clip captions, sweep on other clip captions, every row judged on motion too,
and a profile written. The packaged video model then runs ``auto`` from its shipped profile on
held-out clips through ``triptych quality``."""

from __future__ import annotations

import json
import math
import shutil

import pytest

from triptych import cli
from triptych.accel.teacache_profile import AUTO_THRESHOLD, load_profile
from triptych.calibration.clips import fit_captions
from triptych.calibration.quality import quality_report
from triptych.families.models import PACKAGED_VIDEO

STEPS = 6  # Wan's modulated input depends on the timestep only: 5 distinct changes for the degree-4 fit


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny_video_world(tiny_model_dir, tmp_path_factory):
    model = tmp_path_factory.mktemp("wan") / "wan"
    shutil.copytree(tiny_model_dir("wan-t2v"), model)
    settings = json.loads((model / "triptych.json").read_text())
    (model / "triptych.json").write_text(json.dumps({**settings, "world": "shapes-video"}))
    return model


def test_calibrate_sweeps_a_video_model_on_clip_captions_and_judges_the_motion(tiny_video_world, tmp_path, capsys):
    out = tmp_path / "wan-t2v.json"
    args = ["calibrate", "--model", str(tiny_video_world), "--steps", str(STEPS), "--out", str(out)]
    args += ["--thresholds", "0.1", "1.0", "--warmup", "1", "--max-skips", "0", "1", "--fit-prompts", "2"]
    args += ["--seeds", "1000", "--eval-images", "2", "--batch", "2", "--min-psnr", "0", "--min-ssim", "0"]
    assert cli.main(args) == 0
    printed = capsys.readouterr().out
    assert "| motion kept | track drift |" in printed and f"wrote {out}" in printed
    profile = load_profile(out)
    assert profile.family == "wan-t2v" and profile.steps == STEPS
    assert profile.quality["prompts"] == sorted(fit_captions(2))
    evaluated = profile.sweep["prompts"]
    assert len(evaluated) == 2 and all(" moving " in p for p in evaluated)
    assert not set(evaluated) & set(profile.quality["prompts"])
    rows = profile.sweep["rows"]
    assert len(rows) == 1 + 2 * 2  # plain, then 2 thresholds x (no cap, cap 1)
    assert (rows[0]["motion"], rows[0]["track_error"]) == (1.0, 0.0)  # plain against itself
    assert all(0 <= r["motion"] <= 1 and r["track_error"] >= 0 for r in rows)
    assert profile.target["min_motion_agreement"] == 1.0
    meeting = [r for r in rows[1:] if not r["failures"] and r["skipped_fraction"] > 0]
    for r in rows[1:]:  # a row that lost a clip's motion never meets the target
        assert r["motion"] == 1.0 or r["failures"]
    if meeting:
        chosen = rows[profile.sweep["recommended_row"]]
        assert chosen["skipped_fraction"] == max(r["skipped_fraction"] for r in meeting)
        assert profile.recommended_threshold == chosen["threshold"]


def test_auto_on_the_packaged_video_model_skips_30_percent_and_keeps_the_motion():
    """Two held-out clips (seeds 0, 1) plain and with ``auto``: the shipped profile's schedule skips
    at least 30% of the transformer rows and each clip keeps its direction and colour."""
    report = quality_report(PACKAGED_VIDEO, [AUTO_THRESHOLD], images=2, batch_size=2)
    assert report["world"] and report["steps"] == 20
    (auto,) = report["settings"]
    profile = load_profile(auto["profile"])
    print(f"auto: {auto['skipped_fraction']:.1%} skipped, worst {auto['psnr_min']:.1f} dB, motion {auto['motion']}")
    assert auto["auto"] and auto["teacache_threshold"] == profile.recommended_threshold
    assert auto["skipped_fraction"] >= 0.30
    assert auto["motion"] == 1.0 and math.isfinite(auto["track_error"])
    assert auto["adherence"] == auto["plain_adherence"]
    assert auto["psnr_min"] >= profile.target["min_psnr"]
