"""Does one clip keep the motion of another? Both are read back from pixels and compared.

Used to judge an acceleration against the plain run of the same request: the clip under test keeps
the reference's motion when its direction (:func:`shapeworld.video_scorer.direction_of`) and its
shape colour (the colour read on most frames where a shape was found) are the reference's. Beside
the verdict, the centroid track's largest distance from the reference's, frame by frame (fractions
of the side), tells how far the shape drifted even when the direction held. Nothing here needs the
clip that was asked for: a plain clip that reads no direction is matched only by one that reads
none either.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

from shapeworld.video_scorer import ClipReadout, read_clip


@dataclass(frozen=True)
class MotionAgreement:
    """The clip under test (``direction``, ``color``) against the reference (``plain_*``)."""

    direction: str | None
    plain_direction: str | None
    color: str | None
    plain_color: str | None
    track_error: float  # largest per-frame centroid distance, fraction of the side; inf: a frame lost its shape

    @property
    def kept(self) -> bool:
        """Direction and colour are the reference's."""
        return self.direction == self.plain_direction and self.color == self.plain_color


def clip_color(readout: ClipReadout) -> str | None:
    """The shape colour read on most frames (ties: the earliest frame's); None when none was read."""
    colors = [f.color for f in readout.frames if f.color is not None and f.shape is not None]
    if not colors:
        return None
    counts = Counter(colors)
    best = max(counts.values())
    return next(c for c in colors if counts[c] == best)


def track_error(got: ClipReadout, want: ClipReadout) -> float:
    """Largest distance between the two centroids of a frame; inf when one of them is missing where
    the other is not; 0 when neither clip shows a shape anywhere."""
    worst = 0.0
    for a, b in zip(got.centroids, want.centroids):
        if a is None and b is None:
            continue
        if a is None or b is None:
            return math.inf
        worst = max(worst, math.dist(a, b))
    return worst


def compare_motion(got, plain) -> MotionAgreement:
    """``got`` and ``plain``: clips as :func:`read_clip` takes them (``(F, H, W, 3)``, uint8 or 0..1)."""
    a, b = read_clip(got), read_clip(plain)
    return MotionAgreement(a.direction, b.direction, clip_color(a), clip_color(b), track_error(a, b))
