"""The moving shape world in calibration and quality reports: prompts, and what a clip must keep.

A model whose ``triptych.json`` says ``"world": "shapes-video"`` (the packaged video model) draws
:class:`shapeworld.video.Clip` s. For it, calibration fits on train-split clip captions, sweeps on
other train-split captions (``eval_clips``) and ``triptych quality`` scores held-out ones
(``heldout_clips``), as the image world does with scenes. Besides PSNR, a clip is judged on

- adherence: the asked clip read back (shape, colour and background right on at least
  ``MIN_FRAME_SHARE`` of the frames, and the direction right; ``shapeworld.video_scorer``), and
- motion agreement: the share of clips that keep the plain run's direction and shape colour
  (``shapeworld.motion.compare_motion``); plain against itself is 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

VIDEO_WORLD = "shapes-video"


def is_video_world(model_dir: str | Path) -> bool:
    from triptych.families.geometry import model_defaults

    return model_defaults(Path(model_dir)).get("world") == VIDEO_WORLD


def _pixels(frames: np.ndarray) -> np.ndarray:
    return (np.asarray(frames) * 255).round().astype("uint8")


def fit_captions(n: int) -> list[str]:
    """``n`` train-split clip captions for the fit (never the evaluation ones below)."""
    from shapeworld.video import clip_caption, sample_clips

    return [clip_caption(c) for c in sample_clips(n, "calibrate", "train")]


def eval_clips(n: int, exclude: Sequence[str] = ()) -> list:
    """``n`` train-split clips whose captions are not in ``exclude`` (the fit's prompts)."""
    from shapeworld.video import clip_caption, sample_clips

    return [c for c in sample_clips(4 * n + 8, "calibrate-eval", "train") if clip_caption(c) not in exclude][:n]


def heldout_clips(n: int) -> list:
    """``n`` clips of held-out combinations (what ``triptych quality`` scores)."""
    from shapeworld.video import sample_clips

    return sample_clips(n, "quality", "heldout")


def caption(clip) -> str:
    from shapeworld.video import clip_caption

    return clip_caption(clip)


def clip_adherence(arrays: Sequence[np.ndarray], clips: Sequence) -> float:
    """Share of clips read back as asked (``clip_accuracy``'s ``"all"``)."""
    from shapeworld.video_scorer import clip_accuracy, score_clip

    return clip_accuracy([score_clip(_pixels(a), c) for a, c in zip(arrays, clips)])["all"]


def motion_agreement(arrays: Sequence[np.ndarray], plain: Sequence[np.ndarray]) -> tuple[float, float]:
    """Share of clips keeping their plain clip's direction and colour, and the largest centroid
    track error over them (fraction of the side; inf when a frame lost or gained its shape)."""
    from shapeworld.motion import compare_motion

    found = [compare_motion(_pixels(a), _pixels(p)) for a, p in zip(arrays, plain)]
    return sum(m.kept for m in found) / len(found), max(m.track_error for m in found)
