"""The shape world's clips and their pixel scorer: ground-truth renders read back right, a reversed
clip reads back with the opposite direction, and a clip that does not move has no direction."""

from __future__ import annotations

import numpy as np
import pytest

from shapeworld import combination_split
from shapeworld.video import DIRECTIONS, Clip, clip_caption, iter_all_clips, render_clip, sample_clips
from shapeworld.video_scorer import clip_accuracy, direction_of, read_clip, score_clip

OPPOSITE = {"rightwards": "leftwards", "leftwards": "rightwards", "downwards": "upwards", "upwards": "downwards"}


def _some_clips(n: int = 48) -> list[Clip]:
    clips = iter_all_clips("all")
    return [clips[i] for i in np.random.RandomState(0).choice(len(clips), n, replace=False)]


def test_ground_truth_clips_score_right_and_reversed_ones_wrong():
    clips = _some_clips()
    assert {c.direction for c in clips} == set(DIRECTIONS)
    right, reversed_ = [], []
    for clip in clips:
        video = render_clip(clip)
        assert video.shape == (9, 64, 64, 3) and video.dtype == np.uint8
        right.append(score_clip(video, clip))
        reversed_.append(score_clip(video[::-1], clip))
        assert read_clip(video[::-1]).direction == OPPOSITE[clip.direction]
    assert clip_accuracy(right) == {k: 1.0 for k in clip_accuracy(right)}
    wrong = clip_accuracy(reversed_)
    assert wrong["direction"] == 0.0 and wrong["all"] == 0.0 and wrong["frames_all"] == 1.0


def test_a_still_clip_has_no_direction_and_a_blank_one_nothing():
    clip = Clip("square", "red", "blue", "rightwards", "small")
    still = np.stack([render_clip(clip)[4]] * 9)
    assert read_clip(still).direction is None
    assert score_clip(still, clip)["direction"] is False
    blank = np.zeros((9, 64, 64, 3), dtype=np.uint8)
    r = score_clip(blank, clip)
    assert r["frames_all"] == 0.0 and r["direction"] is False


def test_direction_needs_half_the_frames():
    path = [(0.3 + 0.05 * i, 0.5) for i in range(9)]
    assert direction_of(path)[0] == "rightwards"
    assert direction_of([None] * 5 + path[5:])[0] is None


def test_captions_and_splits():
    clip = Clip("circle", "red", "blue", "rightwards", "small")
    assert clip_caption(clip) == "a red circle moving rightwards on a blue background"
    assert clip_caption(clip, "long") == "a small red circle moving rightwards on a blue background"
    assert clip_caption(clip, "tag") == "small, red, circle, rightwards, blue background"
    assert clip_caption(Clip("cross", "green", "black", "upwards"), "tag").endswith(", upwards, black background")
    assert all(c.split == "train" for c in iter_all_clips("train"))
    held = sample_clips(50, "eval", "heldout")
    assert held == sample_clips(50, "eval", "heldout")
    assert all(combination_split(*c.combination) == "heldout" for c in held)
    with pytest.raises(ValueError):
        Clip("circle", "red", "red", "rightwards")
    with pytest.raises(ValueError):
        Clip("circle", "red", "blue", "sideways")
