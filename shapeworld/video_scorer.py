"""Read a clip back from pixels, and score videos against clips.

Each frame is read by the image scorer (:func:`shapeworld.scorer.analyse`): shape kind, shape
colour and background per frame. The direction of motion comes from the shape centroid's trajectory:
a least-squares line through the centroids of the frames where a shape was found gives the
displacement over the clip; the larger axis and its sign name the direction, provided the shape
travelled at least :data:`MIN_TRAVEL` of the side (ground truth: 0.4) and was found in at least half
of the frames. Unreadable fields are ``None``; it never raises on an odd video.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from shapeworld.scene import PartialScene
from shapeworld.scorer import analyse
from shapeworld.video import Clip

MIN_TRAVEL = 0.15  # fraction of the side the centroid must move for a direction to be read
FRAME_KEYS = ("shape", "color", "background")
#: A video counts for an attribute when it is right on at least this share of its frames.
MIN_FRAME_SHARE = 0.8


@dataclass(frozen=True)
class ClipReadout:
    """Per-frame readouts, the centroids found (``None`` where no shape) and the direction."""

    frames: list[PartialScene]
    centroids: list[tuple[float, float] | None]
    direction: str | None
    displacement: tuple[float, float] | None  # (dx, dy) over the clip, fractions of the side


def direction_of(centroids: list[tuple[float, float] | None]) -> tuple[str | None, tuple[float, float] | None]:
    """Direction and displacement of a centroid trajectory (see the module docstring)."""
    found = [(i, c) for i, c in enumerate(centroids) if c is not None]
    if len(found) < max(2, (len(centroids) + 1) // 2):
        return None, None
    t = np.array([i for i, _ in found], dtype=np.float64)
    xy = np.array([c for _, c in found], dtype=np.float64)
    tc = t - t.mean()
    slope = (tc[:, None] * (xy - xy.mean(0))).sum(0) / (tc**2).sum()
    dx, dy = (slope * (len(centroids) - 1)).tolist()
    if max(abs(dx), abs(dy)) < MIN_TRAVEL:
        return None, (dx, dy)
    if abs(dx) >= abs(dy):
        return ("rightwards" if dx > 0 else "leftwards"), (dx, dy)
    return ("downwards" if dy > 0 else "upwards"), (dx, dy)


def read_clip(frames) -> ClipReadout:
    """``frames``: ``(F, H, W, 3)`` (uint8, or floats in 0..1) or a sequence of images."""
    readouts, centroids = [], []
    for frame in frames:
        readout, features = analyse(frame)
        readouts.append(readout)
        ok = readout.shape is not None and features is not None
        centroids.append((features.cx, features.cy) if ok else None)
    direction, displacement = direction_of(centroids)
    return ClipReadout(readouts, centroids, direction, displacement)


def score_clip(frames, clip: Clip) -> dict[str, float | bool]:
    """Share of frames with each of shape, colour and background right (and with all three), and
    whether the direction reads back right."""
    r = read_clip(frames)
    scene = clip.scene()
    rows = [f.compare(scene) for f in r.frames]
    out: dict[str, float | bool] = {k: float(np.mean([row[k] for row in rows])) for k in FRAME_KEYS}
    out["frames_all"] = float(np.mean([all(row[k] for k in FRAME_KEYS) for row in rows]))
    out["direction"] = r.direction == clip.direction
    return out


def clip_accuracy(results: list[dict[str, float | bool]], share: float = MIN_FRAME_SHARE) -> dict[str, float]:
    """Over videos: for shape, colour, background and ``frames_all`` the share of videos right on at
    least ``share`` of their frames; ``direction`` the share with the direction right; ``all`` the
    share with ``frames_all`` >= ``share`` and the direction right."""
    if not results:
        return {k: 0.0 for k in (*FRAME_KEYS, "frames_all", "direction", "all")}
    out = {k: float(np.mean([r[k] >= share for r in results])) for k in (*FRAME_KEYS, "frames_all")}
    out["direction"] = float(np.mean([bool(r["direction"]) for r in results]))
    out["all"] = float(np.mean([r["frames_all"] >= share and bool(r["direction"]) for r in results]))
    return out
