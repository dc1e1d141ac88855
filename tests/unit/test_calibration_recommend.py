"""``recommend``: the largest saving among the rows that met the target; ties go to the smaller
threshold, then to the higher worst-case PSNR; the shipped profiles hold what it picks from their
own sweep rows."""

from __future__ import annotations

import json

import pytest

from triptych.calibration.sweep import recommend
from triptych.families.models import PACKAGED_DEFAULT


def row(threshold, skipped, psnr_min, failures=()):
    return {"threshold": threshold, "skipped_fraction": skipped, "psnr_min": psnr_min, "failures": list(failures)}


def test_the_largest_saving_that_met_the_target_wins():
    rows = [row(0, 0, float("inf")), row(0.1, 0.3, 40), row(0.3, 0.5, 20, ["worst PSNR"]), row(0.2, 0.4, 31)]
    assert recommend(rows) is rows[3]


def test_a_tie_on_saving_goes_to_the_smaller_threshold_then_to_the_higher_worst_psnr():
    rows = [row(0.3, 0.4, 45), row(0.1, 0.4, 30.7), row(0.1, 0.4, 36.1), row(0.1, 0.4, 33.8)]
    assert recommend(rows) is rows[2]


def test_nothing_is_recommended_when_nothing_met_the_target_or_saved():
    assert recommend([row(0, 0, float("inf")), row(0.1, 0.2, 10, ["worst PSNR"])]) is None
    assert recommend([row(0.1, 0.0, 60)]) is None


@pytest.mark.parametrize(
    "profile",
    [
        PACKAGED_DEFAULT / "teacache" / "qwen-image-20steps.json",
        PACKAGED_DEFAULT.parent / "video" / "teacache" / "wan-t2v-20steps.json",
    ],
    ids=["default", "video"],
)
def test_each_shipped_profile_holds_what_recommend_picks_from_its_own_sweep(profile):
    data = json.loads(profile.read_text())
    rows = data["sweep"]["rows"]
    chosen = recommend(rows)
    assert rows.index(chosen) == data["sweep"]["recommended_row"]
    assert chosen["threshold"] == data["recommended_threshold"]
    assert (chosen["warmup"], chosen["max_skips"], chosen["forecast"]) == (
        data["warmup"],
        data["max_skips"],
        data["forecast"],
    )
