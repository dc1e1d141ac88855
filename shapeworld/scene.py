"""Scene model, vocabulary, train/held-out splits and seeded sampling.

A scene is one flat-coloured shape on a flat-coloured background.  Every
attribute is a word from a small closed vocabulary, so text prompts, edit
instructions and pixel readouts can all be compared exactly.

The held-out split is a fixed set of (shape, colour, background)
*combinations* chosen by a stable hash; the train split never produces them,
so held-out prompts are genuinely unseen compositions of seen words.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import random
from dataclasses import dataclass, fields
from typing import Literal

logger = logging.getLogger(__name__)

SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "cross")
"""Shape kinds. ``cross`` is a thick plus sign: unlike a star it stays
concave (and readable) when blurred, so the scorer can tell it apart."""

COLORS: dict[str, tuple[int, int, int]] = {
    "red": (255, 0, 0),
    "green": (0, 255, 0),
    "blue": (0, 0, 255),
    "yellow": (255, 255, 0),
    "magenta": (255, 0, 255),
    "cyan": (0, 255, 255),
    "white": (255, 255, 255),
    "black": (0, 0, 0),
}
"""Named colours: the eight corners of the RGB cube, pairwise >= 255 apart."""

COLOR_NAMES: tuple[str, ...] = tuple(COLORS)
POSITIONS: tuple[str, ...] = ("left", "right", "top", "bottom", "centre")
SIZES: tuple[str, ...] = ("small", "large")
ATTRIBUTES: tuple[str, ...] = ("shape", "color", "background", "position", "size")

# Shape centre (x, y) as a fraction of the image side, per position.
POSITION_ANCHORS: dict[str, tuple[float, float]] = {
    "left": (0.3, 0.5),
    "right": (0.7, 0.5),
    "top": (0.5, 0.3),
    "bottom": (0.5, 0.7),
    "centre": (0.5, 0.5),
}
# Nominal shape radius as a fraction of the image side, per size.
SIZE_RADII: dict[str, float] = {"small": 0.12, "large": 0.22}

Split = Literal["train", "heldout", "all"]
HELDOUT_PERCENT = 10
_SPLIT_SALT = "triptych-world-v3900"  # chosen so held-out is balanced (21 combos)


@dataclass(frozen=True)
class Scene:
    """One shape of one colour on a plain background.

    Attributes:
        shape: one of :data:`SHAPES`.
        color: shape colour, one of :data:`COLOR_NAMES`.
        background: background colour, one of :data:`COLOR_NAMES`, != color.
        position: one of :data:`POSITIONS`.
        size: one of :data:`SIZES`.
    """

    shape: str
    color: str
    background: str
    position: str = "centre"
    size: str = "large"

    def __post_init__(self) -> None:
        _check("shape", self.shape, SHAPES)
        _check("color", self.color, COLOR_NAMES)
        _check("background", self.background, COLOR_NAMES)
        _check("position", self.position, POSITIONS)
        _check("size", self.size, SIZES)
        if self.color == self.background:
            raise ValueError(f"shape colour equals background colour: {self.color}")

    @property
    def combination(self) -> tuple[str, str, str]:
        """The (shape, color, background) triple that decides the split."""
        return (self.shape, self.color, self.background)

    @property
    def split(self) -> str:
        """``"train"`` or ``"heldout"`` for this scene's combination."""
        return combination_split(*self.combination)


@dataclass(frozen=True)
class PartialScene:
    """Scene fields that may be unknown (``None``).

    Returned by :func:`shapeworld.parse_caption` and
    :func:`shapeworld.read_scene`.
    """

    shape: str | None = None
    color: str | None = None
    background: str | None = None
    position: str | None = None
    size: str | None = None

    def compare(self, scene: Scene) -> dict[str, bool]:
        """Per-attribute correctness against ``scene`` (unknown counts as wrong)."""
        return {a: getattr(self, a) == getattr(scene, a) for a in ATTRIBUTES}

    def to_scene(self) -> Scene | None:
        """A full :class:`Scene` if every field is known and valid, else ``None``."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        if any(v is None for v in values.values()):
            return None
        try:
            return Scene(**values)
        except ValueError:
            return None


def _check(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"invalid {name} {value!r}; expected one of {allowed}")


def combination_split(shape: str, color: str, background: str) -> str:
    """Return ``"heldout"`` for ~10% of combinations (stable hash), else ``"train"``."""
    key = f"{_SPLIT_SALT}|{shape}|{color}|{background}".encode()
    bucket = int.from_bytes(hashlib.sha256(key).digest()[:8], "big") % 100
    return "heldout" if bucket < HELDOUT_PERCENT else "train"


def all_combinations() -> list[tuple[str, str, str]]:
    """Every valid (shape, color, background) triple, in vocabulary order."""
    return [(s, c, b) for s in SHAPES for c in COLOR_NAMES for b in COLOR_NAMES if c != b]


def combinations(split: Split = "train") -> list[tuple[str, str, str]]:
    """The combinations that belong to ``split`` (``"all"`` for every one)."""
    return list(_combinations(split))


@functools.cache
def _combinations(split: str) -> tuple[tuple[str, str, str], ...]:
    if split == "all":
        return tuple(all_combinations())
    if split not in ("train", "heldout"):
        raise ValueError(f"unknown split {split!r}")
    return tuple(c for c in all_combinations() if combination_split(*c) == split)


def in_split(scene: Scene, split: Split) -> bool:
    """Whether ``scene`` may be produced by ``split``."""
    return split == "all" or scene.split == split


def make_rng(seed: int | str, *tags: str) -> random.Random:
    """A ``random.Random`` seeded from ``seed`` and ``tags`` (stable across runs)."""
    return random.Random("|".join([str(seed), *tags]))


def sample_scene(rng: random.Random, split: Split = "train") -> Scene:
    """Draw one scene: a uniform combination of ``split``, uniform position/size."""
    shape, color, background = rng.choice(_combinations(split))
    return Scene(
        shape=shape,
        color=color,
        background=background,
        position=rng.choice(POSITIONS),
        size=rng.choice(SIZES),
    )


def sample_scenes(n: int, seed: int | str = 0, split: Split = "train") -> list[Scene]:
    """Deterministically sample ``n`` scenes of ``split`` from ``seed``.

    The same ``(n, seed, split)`` always gives the same list, and a longer
    list extends a shorter one with the same seed.
    """
    if n < 0:
        raise ValueError("n must be >= 0")
    rng = make_rng(seed, "scenes", split)
    return [sample_scene(rng, split) for _ in range(n)]


def iter_all_scenes(split: Split = "all") -> list[Scene]:
    """Every scene of ``split``: combinations x positions x sizes."""
    return [Scene(s, c, b, p, z) for (s, c, b) in combinations(split) for p in POSITIONS for z in SIZES]
