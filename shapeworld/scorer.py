"""Read a scene back from pixels, and score images against scenes.

The readout uses only the image:

1. every pixel is classified to the nearest named colour (RGB distance);
2. background = majority label of a border ring;
3. the largest 4-connected blob of non-background labels is the shape
   candidate; its majority label is the shape colour;
4. the shape mask is every pixel closer to the shape colour than to the
   background colour (a 50% threshold on blended edges), largest blob kept;
5. kind from mask geometry: vertical/horizontal skewness (triangle),
   fill (area / bounding-box area) + solidity (area / convex hull area)
   (cross), fill (square vs circle); position from the mask centroid
   (nearest anchor); size from the bounding-box extent.  Images under
   64 px are measured on a bilinearly upsampled coverage map.

Majority votes, a blob filter and threshold-free nearest-colour rules make
the readout tolerant of blur, noise and colour drift in generated images.
Fields that cannot be read are ``None``; the function never raises on an
odd image.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
from PIL import Image

from shapeworld.scene import (
    ATTRIBUTES,
    COLOR_NAMES,
    COLORS,
    POSITION_ANCHORS,
    PartialScene,
    Scene,
)

logger = logging.getLogger(__name__)

_PALETTE = np.array([COLORS[c] for c in COLOR_NAMES], dtype=np.float32)
_PALETTE_SQ = (_PALETTE**2).sum(axis=-1)

# Decision thresholds (see tests/unit/test_world_scorer.py for the margins).
SKEW_TRIANGLE = 0.25  # |skewness| of the mask; triangle ~0.57, others ~0
CROSS_FILL_PLUS_SOLIDITY = 1.55  # cross ~1.3 (1.5 blurred), circle >= 1.6
FILL_SQUARE = 0.835  # square >= 0.85 (even blurred + noisy), circle <= 0.82
EXTENT_LARGE = 0.31  # bbox side / image side; small <= 0.25, large >= 0.38
MIN_AREA_FRAC = 0.004  # smaller blobs are "no shape"
MAX_AREA_FRAC = 0.6  # larger blobs are "no shape" (or a wrong background)
MIN_BORDER_AGREEMENT = 0.4
MASK_MIN_SIDE = 64  # smaller images are measured on an upsampled mask


@dataclass(frozen=True)
class ShapeFeatures:
    """Geometric measurements of the shape mask (coordinates in [0, 1])."""

    area: float  # fraction of the image
    cx: float
    cy: float
    extent: float  # max(bbox width, bbox height) / image side
    fill: float  # area / bbox area
    solidity: float  # area / convex hull area
    skew: float  # max(|skew_x|, |skew_y|) of mask pixel coordinates


def to_rgb_array(image: Image.Image | np.ndarray) -> np.ndarray:
    """``(H, W, 3)`` float32 RGB in 0..255 from a PIL image or an array.

    Float arrays with max <= 1 are treated as 0..1; grey or RGBA inputs are
    converted.
    """
    if isinstance(image, Image.Image):
        return np.asarray(image.convert("RGB"), dtype=np.float32)
    arr = np.asarray(image)
    if arr.ndim == 2:
        arr = np.stack([arr] * 3, axis=-1)
    if arr.ndim == 3 and arr.shape[0] in (1, 3, 4) and arr.shape[-1] not in (1, 3, 4):
        arr = np.moveaxis(arr, 0, -1)  # CHW -> HWC
    if arr.shape[-1] == 1:
        arr = np.repeat(arr, 3, axis=-1)
    arr = arr[..., :3].astype(np.float32)
    if arr.size and np.issubdtype(np.asarray(image).dtype, np.floating) and arr.max() <= 1.0:
        arr = arr * 255.0
    return arr


def nearest_color_labels(rgb: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Nearest palette index per pixel and the squared distances ``(H, W, 8)``."""
    d2 = (rgb**2).sum(axis=-1, keepdims=True) - 2.0 * (rgb @ _PALETTE.T) + _PALETTE_SQ
    return d2.argmin(axis=-1), d2


def largest_component(mask: np.ndarray) -> np.ndarray:
    """The largest 4-connected component of a boolean mask (empty if none).

    Works on horizontal runs with a union-find, so the Python-level cost is
    proportional to the number of runs rather than pixels.
    """
    h, w = mask.shape
    padded = np.zeros((h, w + 2), dtype=np.int8)
    padded[:, 1:-1] = mask
    edges = np.diff(padded, axis=1)
    rows_s, cols_s = np.nonzero(edges == 1)
    _, cols_e = np.nonzero(edges == -1)  # same order: row-major, runs alternate
    runs = list(zip(rows_s.tolist(), cols_s.tolist(), cols_e.tolist()))
    parent = list(range(len(runs)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    prev: list[int] = []  # run indices of the previous row
    cur: list[int] = []
    row = -1
    for i, (r, a, b) in enumerate(runs):
        if r != row:
            prev, cur = (cur if r == row + 1 else []), []
            row = r
        for j in prev:
            _, pa, pb = runs[j]
            if pa < b and a < pb:  # column ranges [a, b) overlap
                ri, rj = find(i), find(j)
                if ri != rj:
                    parent[ri] = rj
        cur.append(i)
    out = np.zeros((h, w), dtype=bool)
    if not runs:
        return out
    sizes: dict[int, int] = {}
    for i, (_, a, b) in enumerate(runs):
        root = find(i)
        sizes[root] = sizes.get(root, 0) + (b - a)
    best = max(sizes, key=lambda k: (sizes[k], -k))
    for i, (r, a, b) in enumerate(runs):
        if find(i) == best:
            out[r, a:b] = True
    return out


def coverage_mask(rgb: np.ndarray, fg: np.ndarray, bg: np.ndarray) -> np.ndarray:
    """Pixels more than half covered by ``fg`` over ``bg``.

    Coverage is the projection of each pixel onto the bg->fg colour segment
    (equivalently: closer to fg than to bg).  Images smaller than
    :data:`MASK_MIN_SIDE` have the coverage map bilinearly upsampled first,
    which recovers a sub-pixel outline and keeps small shapes measurable.
    """
    axis = fg - bg
    cov = ((rgb - bg) @ axis) / float(axis @ axis)
    side = min(cov.shape)
    if side < MASK_MIN_SIDE:
        k = -(-MASK_MIN_SIDE // side)
        h, w = cov.shape
        im = Image.fromarray(cov.astype(np.float32))
        cov = np.asarray(im.resize((w * k, h * k), Image.Resampling.BILINEAR))
    return cov > 0.5


def _hull_area(points: np.ndarray) -> float:
    """Area of the convex hull of 2-D points (Andrew's monotone chain)."""
    pts = sorted(set(map(tuple, points.tolist())))
    if len(pts) < 3:
        return 0.0

    def cross(o: tuple, a: tuple, b: tuple) -> float:
        return (a[0] - o[0]) * (b[1] - o[1]) - (a[1] - o[1]) * (b[0] - o[0])

    lower: list[tuple] = []
    for p in pts:
        while len(lower) >= 2 and cross(lower[-2], lower[-1], p) <= 0:
            lower.pop()
        lower.append(p)
    upper: list[tuple] = []
    for p in reversed(pts):
        while len(upper) >= 2 and cross(upper[-2], upper[-1], p) <= 0:
            upper.pop()
        upper.append(p)
    hull = np.array(lower[:-1] + upper[:-1], dtype=np.float64)
    x, y = hull[:, 0], hull[:, 1]
    return float(abs(np.dot(x, np.roll(y, -1)) - np.dot(y, np.roll(x, -1))) / 2.0)


def _skewness(values: np.ndarray) -> float:
    c = values - values.mean()
    sd = float(np.sqrt((c**2).mean()))
    return float((c**3).mean() / sd**3) if sd > 0 else 0.0


def shape_features(mask: np.ndarray) -> ShapeFeatures | None:
    """Measure a non-empty boolean mask; ``None`` if it is empty."""
    ys, xs = np.nonzero(mask)
    n = len(xs)
    if n == 0:
        return None
    h, w = mask.shape
    side = float(max(h, w))
    bw, bh = xs.max() - xs.min() + 1, ys.max() - ys.min() + 1
    # Hull over pixel corners of each row's leftmost and rightmost pixel.
    corners = []
    for row in np.unique(ys):
        rx = xs[ys == row]
        lo, hi = rx.min(), rx.max() + 1
        corners += [(lo, row), (lo, row + 1), (hi, row), (hi, row + 1)]
    hull = _hull_area(np.array(corners))
    return ShapeFeatures(
        area=n / float(h * w),
        cx=(xs.mean() + 0.5) / w,
        cy=(ys.mean() + 0.5) / h,
        extent=max(bw, bh) / side,
        fill=n / float(bw * bh),
        solidity=n / hull if hull > 0 else 1.0,
        skew=max(abs(_skewness(xs.astype(np.float64))), abs(_skewness(ys.astype(np.float64)))),
    )


def classify_shape(f: ShapeFeatures) -> str:
    """Shape kind from mask features (decision list, see module docstring)."""
    if f.skew > SKEW_TRIANGLE:
        return "triangle"
    if f.fill + f.solidity < CROSS_FILL_PLUS_SOLIDITY:
        return "cross"
    if f.fill > FILL_SQUARE:
        return "square"
    return "circle"


def classify_position(cx: float, cy: float) -> str:
    """Nearest position anchor to the centroid ``(cx, cy)``."""
    return min(
        POSITION_ANCHORS,
        key=lambda k: (POSITION_ANCHORS[k][0] - cx) ** 2 + (POSITION_ANCHORS[k][1] - cy) ** 2,
    )


def _mode(labels: np.ndarray) -> tuple[int, float]:
    counts = np.bincount(labels.ravel(), minlength=len(COLOR_NAMES))
    best = int(counts.argmax())
    return best, counts[best] / max(1, counts.sum())


def analyse(image: Image.Image | np.ndarray) -> tuple[PartialScene, ShapeFeatures | None]:
    """Readout plus the mask features it was derived from (for debugging)."""
    rgb = to_rgb_array(image)
    if rgb.ndim != 3 or min(rgb.shape[:2]) < 8:
        return PartialScene(), None
    h, w = rgb.shape[:2]
    labels, d2 = nearest_color_labels(rgb)
    ring = max(1, min(h, w) // 32)
    border = np.concatenate(
        [labels[:ring].ravel(), labels[-ring:].ravel(), labels[:, :ring].ravel(), labels[:, -ring:].ravel()]
    )
    bg, agreement = _mode(border)
    if agreement < MIN_BORDER_AGREEMENT:
        logger.debug("no clear background: border agreement %.2f", agreement)
        return PartialScene(), None
    background = COLOR_NAMES[bg]
    candidate = largest_component(labels != bg)
    n_pixels = float(h * w)
    if candidate.sum() < max(4.0, MIN_AREA_FRAC * n_pixels):
        logger.debug("no shape: largest blob has %d pixels", int(candidate.sum()))
        return PartialScene(background=background), None
    fg, _ = _mode(labels[candidate])
    mask = largest_component(coverage_mask(rgb, _PALETTE[fg], _PALETTE[bg]))
    features = shape_features(mask)
    if features is None or not (MIN_AREA_FRAC <= features.area <= MAX_AREA_FRAC):
        logger.debug("no shape: mask features %s", features)
        return PartialScene(background=background), features
    readout = PartialScene(
        shape=classify_shape(features),
        color=COLOR_NAMES[fg],
        background=background,
        position=classify_position(features.cx, features.cy),
        size="large" if features.extent >= EXTENT_LARGE else "small",
    )
    return readout, features


def read_scene(image: Image.Image | np.ndarray) -> PartialScene:
    """Read shape, colours, position and size from pixels; unknowns are ``None``."""
    return analyse(image)[0]


def score(image: Image.Image | np.ndarray, scene: Scene) -> dict[str, bool]:
    """Per-attribute correctness of ``image`` against the intended ``scene``.

    Keys are :data:`~shapeworld.scene.ATTRIBUTES`
    (shape, color, background, position, size).
    """
    return read_scene(image).compare(scene)


def accuracy(results: list[dict[str, bool]]) -> dict[str, float]:
    """Mean of each attribute over :func:`score` results, plus ``"all"``
    (fraction of items with every attribute right)."""
    if not results:
        return {a: 0.0 for a in (*ATTRIBUTES, "all")}
    out = {a: sum(r[a] for r in results) / len(results) for a in ATTRIBUTES}
    out["all"] = sum(all(r[a] for a in ATTRIBUTES) for r in results) / len(results)
    return out
