"""``shapeworld.motion``: a clip keeps another's motion when its direction and shape colour read back
the same. Rendered clips against themselves, shifted by a pixel, reversed, recoloured, still, and
with a frame blanked out."""

from __future__ import annotations

import numpy as np

from shapeworld.motion import clip_color, compare_motion
from shapeworld.video import DIRECTIONS, Clip, render_clip
from shapeworld.video_scorer import read_clip

CLIPS = [
    Clip("circle", "red", "blue", "rightwards", "large"),
    Clip("square", "yellow", "black", "leftwards", "small"),
    Clip("triangle", "white", "magenta", "downwards", "large"),
    Clip("cross", "green", "cyan", "upwards", "small"),
]


def test_every_direction_reads_back_and_a_clip_keeps_its_own_motion():
    assert {c.direction for c in CLIPS} == set(DIRECTIONS)
    for clip in CLIPS:
        video = render_clip(clip)
        m = compare_motion(video, video)
        assert (m.direction, m.color) == (clip.direction, clip.color) == (m.plain_direction, m.plain_color)
        assert m.kept and m.track_error == 0.0


def test_a_reversed_clip_does_not_keep_the_motion():
    for clip in CLIPS:
        video = render_clip(clip)
        m = compare_motion(video[::-1], video)
        assert m.color == m.plain_color and m.direction != m.plain_direction and not m.kept
        # the first and last frames swap: the centre moved 0.4 of the side (shapeworld.video)
        assert m.track_error > 0.35


def test_a_one_pixel_shift_keeps_it_and_a_recoloured_clip_does_not():
    clip = CLIPS[0]
    video = render_clip(clip)
    shifted = np.roll(video, 1, axis=2)  # one pixel right; the background wraps round unchanged
    m = compare_motion(shifted, video)
    assert m.kept and 0 < m.track_error < 0.05  # 1/64 of the side
    other = render_clip(Clip(clip.shape, "green", clip.background, clip.direction, clip.size))
    m = compare_motion(other, video)
    assert m.direction == m.plain_direction and (m.color, m.plain_color) == ("green", "red") and not m.kept


def test_a_still_clip_and_a_lost_frame():
    video = render_clip(CLIPS[1])
    still = np.stack([video[4]] * len(video))
    m = compare_motion(still, video)
    assert m.direction is None and not m.kept
    blanked = video.copy()
    blanked[3] = blanked[3, 0, 0]  # the background colour everywhere: no shape on frame 3
    m = compare_motion(blanked, video)
    assert m.kept and m.track_error == float("inf")  # 8 of 9 frames still give the direction


def test_clip_color_is_the_majority_of_frames_with_a_shape():
    video = render_clip(CLIPS[2])
    assert clip_color(read_clip(video)) == "white"
    blank = np.zeros_like(video)
    assert clip_color(read_clip(blank)) is None
