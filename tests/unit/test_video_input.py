"""``core/video_input``: which frames a clip's sampling keeps, and decoding only those."""

from __future__ import annotations

import numpy as np
import pytest

from triptych.core.errors import InvalidParam
from triptych.core.media import encode_video
from triptych.core.video_input import VideoLimits, decode_video, sample_indices


def test_sampling_follows_fps_and_spreads_a_long_clip_uniformly():
    assert sample_indices(24, 8.0, 2.0, 16) == [0, 5, 9, 14, 18, 23]  # 3 s at 2 fps: 6 frames, ends included
    long = sample_indices(400, 16.0, 2.0, 16)
    assert len(long) == 16 and long[0] == 0 and long[-1] == 399
    gaps = np.diff(long)
    assert gaps.max() - gaps.min() <= 1  # uniform: 399 / 15 = 26.6 frames apart
    assert sample_indices(3, 30.0, 2.0, 16) == [0]  # a tenth of a second: still one frame
    assert sample_indices(0, 30.0, 2.0, 16) == []


def test_decode_keeps_the_sampled_frames_in_order_with_their_times():
    frames = np.zeros((40, 16, 16, 3), np.uint8)
    frames[:, :, :, 1] = (np.arange(40) * 6)[:, None, None]  # green encodes the frame index
    got = decode_video(encode_video(frames, fps=10), VideoLimits(), "clip", fps=1.0)
    assert [f.seconds for f in got] == [0.0, 1.3, 2.6, 3.9]  # 4 s at 1 fps: indices 0, 13, 26, 39
    green = [int(np.asarray(f.image)[8, 8, 1]) for f in got]
    assert all(abs(g - 6 * i) <= 8 for g, i in zip(green, (0, 13, 26, 39))), green  # lossy H.264


def test_limits_and_garbage_are_refused_naming_the_field():
    data = encode_video(np.zeros((4, 16, 32, 3), np.uint8), fps=4)
    with pytest.raises(InvalidParam, match="at most 100 bytes") as e:
        decode_video(data, VideoLimits(max_bytes=100), "m.video_url", fps=2.0)
    assert e.value.field == "m.video_url"
    with pytest.raises(InvalidParam, match="at most 256 pixels"):
        decode_video(data, VideoLimits(max_pixels=256), "m.video_url", fps=2.0)
    with pytest.raises(InvalidParam, match="not a decodable video"):
        decode_video(b"\x00" * 300, VideoLimits(), "m.video_url", fps=2.0)
