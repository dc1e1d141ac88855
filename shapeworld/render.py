"""Deterministic rasteriser for :class:`~shapeworld.scene.Scene`.

Shapes are drawn with PIL at ``supersample`` times the target resolution and
box-filtered down, which anti-aliases edges while keeping the output a pure
function of ``(scene, size, supersample)``.

Geometry (``r`` is the nominal radius from :data:`SIZE_RADII`, all shapes are
centred on their area centroid at the position anchor):

* circle: radius ``r``;
* square: axis aligned, half side ``0.88 r`` (about the circle's area);
* triangle: equilateral, pointing up, circumradius ``1.2 r``;
* cross: plus sign, half extent ``r``, arm half width ``r / 3``.
"""

from __future__ import annotations

import math

import numpy as np
from PIL import Image, ImageDraw

from shapeworld.scene import COLORS, POSITION_ANCHORS, SIZE_RADII, Scene

SQUARE_HALF_SIDE = 0.88
TRIANGLE_CIRCUMRADIUS = 1.2
CROSS_ARM_HALF_WIDTH = 1.0 / 3.0

Point = tuple[float, float]


def shape_polygon(shape: str, cx: float, cy: float, r: float) -> list[Point]:
    """Vertices of ``shape`` centred at ``(cx, cy)`` with nominal radius ``r``.

    Circles are returned as a 64-gon (the renderer draws a true ellipse).
    """
    if shape == "circle":
        return [(cx + r * math.cos(2 * math.pi * k / 64), cy + r * math.sin(2 * math.pi * k / 64)) for k in range(64)]
    if shape == "square":
        h = SQUARE_HALF_SIDE * r
        return [(cx - h, cy - h), (cx + h, cy - h), (cx + h, cy + h), (cx - h, cy + h)]
    if shape == "triangle":
        big = TRIANGLE_CIRCUMRADIUS * r
        return [
            (cx + big * math.cos(a), cy - big * math.sin(a))
            for a in (math.pi / 2, math.pi / 2 + 2 * math.pi / 3, math.pi / 2 + 4 * math.pi / 3)
        ]
    if shape == "cross":
        h, w = r, CROSS_ARM_HALF_WIDTH * r
        rel = [
            (-w, -h),
            (w, -h),
            (w, -w),
            (h, -w),
            (h, w),
            (w, w),
            (w, h),
            (-w, h),
            (-w, w),
            (-h, w),
            (-h, -w),
            (-w, -w),
        ]
        return [(cx + x, cy + y) for x, y in rel]
    raise ValueError(f"unknown shape {shape!r}")


def render(
    scene: Scene, size: int = 64, supersample: int = 4, centre: tuple[float, float] | None = None
) -> Image.Image:
    """Render ``scene`` as an RGB image of ``size`` x ``size`` pixels.

    Args:
        scene: the scene to draw.
        size: output side in pixels (32, 64 and 128 are tested; >= 16 works).
        supersample: anti-aliasing factor; ``1`` gives hard edges.
        centre: the shape's centre (x, y) as fractions of the side, instead of the anchor of
            ``scene.position`` (video frames draw the shape along a path).

    Returns:
        A new ``PIL.Image.Image`` in mode ``"RGB"``; identical bytes for
        identical arguments.
    """
    if size < 8:
        raise ValueError("size must be >= 8")
    if supersample < 1:
        raise ValueError("supersample must be >= 1")
    big = size * supersample
    image = Image.new("RGB", (big, big), COLORS[scene.background])
    draw = ImageDraw.Draw(image)
    ax, ay = centre if centre is not None else POSITION_ANCHORS[scene.position]
    # Pixel centres sit at integer + 0.5 in PIL's polygon coordinates.
    cx, cy, r = ax * big - 0.5, ay * big - 0.5, SIZE_RADII[scene.size] * big
    fill = COLORS[scene.color]
    if scene.shape == "circle":
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=fill)
    else:
        draw.polygon(shape_polygon(scene.shape, cx, cy, r), fill=fill)
    if supersample > 1:
        image = image.resize((size, size), Image.Resampling.BOX)
    return image


def render_array(scene: Scene, size: int = 64, supersample: int = 4) -> np.ndarray:
    """:func:`render` as a ``(size, size, 3)`` ``uint8`` array."""
    return np.asarray(render(scene, size, supersample), dtype=np.uint8)
