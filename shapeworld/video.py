"""Clips: one shape moving in a straight line across a plain background.

A :class:`Clip` is a scene whose position changes over time: the shape's centre moves at constant
speed from one position anchor to the opposite one (left -> right, right -> left, top -> bottom,
bottom -> top; the anchors of :data:`~shapeworld.scene.POSITION_ANCHORS`, 0.4 of the side apart),
so the first frame is the scene "at the left" and the last "at the right". Shape, colours and size do
not change. The train/held-out split is the image world's: by (shape, colour, background)
combination, so held-out clips are unseen compositions of seen words and motions.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from shapeworld.render import render
from shapeworld.scene import (
    POSITION_ANCHORS,
    SIZES,
    Scene,
    Split,
    _check,
    _combinations,
    combinations,
    make_rng,
)

#: direction -> (start position, end position); the centre moves between their anchors.
DIRECTIONS: dict[str, tuple[str, str]] = {
    "rightwards": ("left", "right"),
    "leftwards": ("right", "left"),
    "downwards": ("top", "bottom"),
    "upwards": ("bottom", "top"),
}
CLIP_FRAMES = 9
CLIP_CAPTION_STYLES: tuple[str, ...] = ("short", "long", "tag")


@dataclass(frozen=True)
class Clip:
    """A shape of one colour on a plain background, moving in ``direction`` (:data:`DIRECTIONS`)."""

    shape: str
    color: str
    background: str
    direction: str
    size: str = "large"

    def __post_init__(self) -> None:
        _check("direction", self.direction, tuple(DIRECTIONS))
        self.scene()  # the still scene's own checks: shape, colours, size

    @property
    def combination(self) -> tuple[str, str, str]:
        return self.scene().combination

    @property
    def split(self) -> str:
        return self.scene().split

    def scene(self) -> Scene:
        """The still scene of any one frame (position left at ``centre``: it moves)."""
        return Scene(self.shape, self.color, self.background, "centre", self.size)

    def centres(self, frames: int = CLIP_FRAMES) -> list[tuple[float, float]]:
        """The shape's centre in each frame, as fractions of the side."""
        (x0, y0), (x1, y1) = (POSITION_ANCHORS[p] for p in DIRECTIONS[self.direction])
        steps = max(1, frames - 1)
        return [(x0 + (x1 - x0) * i / steps, y0 + (y1 - y0) * i / steps) for i in range(frames)]


def clip_caption(clip: Clip, style: str = "short") -> str:
    """``"a red circle moving rightwards on a blue background"`` (short); ``"long"`` adds the size;
    ``"tag"`` is ``"small, red, circle, rightwards, blue background"``. Every style names the direction
    with its own word (the direction key): in ``"from left to right"`` and ``"from right to left"`` the
    two directions differ only in word order, which the video model's tiny text encoder did not learn
    to tell apart (``triptych/assets/video/MODEL_CARD.md``)."""
    if style == "short":
        return f"a {clip.color} {clip.shape} moving {clip.direction} on a {clip.background} background"
    if style == "long":
        return f"a {clip.size} {clip.color} {clip.shape} moving {clip.direction} on a {clip.background} background"
    if style == "tag":
        return f"{clip.size}, {clip.color}, {clip.shape}, {clip.direction}, {clip.background} background"
    raise ValueError(f"unknown caption style {style!r}; expected one of {CLIP_CAPTION_STYLES}")


def render_clip(clip: Clip, frames: int = CLIP_FRAMES, size: int = 64) -> np.ndarray:
    """``(frames, size, size, 3)`` uint8: each frame is :func:`render` of the clip's scene with the
    shape at that frame's centre."""
    scene = clip.scene()
    return np.stack([np.asarray(render(scene, size, centre=c), dtype=np.uint8) for c in clip.centres(frames)])


def sample_clip(rng, split: Split = "train") -> Clip:
    shape, color, background = rng.choice(_combinations(split))
    return Clip(shape, color, background, rng.choice(tuple(DIRECTIONS)), rng.choice(SIZES))


def sample_clips(n: int, seed: int | str = 0, split: Split = "train") -> list[Clip]:
    """Deterministically sample ``n`` clips of ``split`` (uniform combination, direction, size)."""
    if n < 0:
        raise ValueError("n must be >= 0")
    rng = make_rng(seed, "clips", split)
    return [sample_clip(rng, split) for _ in range(n)]


def iter_all_clips(split: Split = "all") -> list[Clip]:
    """Every clip of ``split``: combinations x directions x sizes."""
    return [Clip(s, c, b, d, z) for (s, c, b) in combinations(split) for d in DIRECTIONS for z in SIZES]
