"""Captions for scenes and a tolerant parser for free text about scenes.

:func:`caption` writes the canonical prompts the model is trained on;
:func:`parse_caption` reads colour/shape/position/size words back out of any
text (canonical captions, prompts, or a VLM's free-form answer such as
"The image shows a red circle on a blue background.").
"""

from __future__ import annotations

import logging
import re
from typing import Literal

from shapeworld.scene import COLOR_NAMES, PartialScene, Scene

logger = logging.getLogger(__name__)

CaptionStyle = Literal["short", "long", "tag"]
CAPTION_STYLES: tuple[str, ...] = ("short", "long", "tag")

POSITION_PHRASES: dict[str, str] = {
    "left": "at the left",
    "right": "at the right",
    "top": "at the top",
    "bottom": "at the bottom",
    "centre": "in the centre",
}

SHAPE_WORDS: dict[str, str] = {
    "circle": "circle",
    "circles": "circle",
    "disc": "circle",
    "disk": "circle",
    "dot": "circle",
    "ball": "circle",
    "round": "circle",
    "oval": "circle",
    "ellipse": "circle",
    "square": "square",
    "squares": "square",
    "box": "square",
    "rectangle": "square",
    "block": "square",
    "triangle": "triangle",
    "triangles": "triangle",
    "triangular": "triangle",
    "pyramid": "triangle",
    "cross": "cross",
    "crosses": "cross",
    "plus": "cross",
    "+": "cross",
}
GENERIC_SHAPE_WORDS = frozenset({"shape", "object", "figure", "form", "thing", "it"})
COLOR_WORDS: dict[str, str] = {
    **{c: c for c in COLOR_NAMES},
    "purple": "magenta",
    "pink": "magenta",
    "violet": "magenta",
    "fuchsia": "magenta",
    "turquoise": "cyan",
    "aqua": "cyan",
    "teal": "cyan",
    "lime": "green",
    "gold": "yellow",
    "golden": "yellow",
}
POSITION_WORDS: dict[str, str] = {
    "left": "left",
    "right": "right",
    "top": "top",
    "upper": "top",
    "bottom": "bottom",
    "lower": "bottom",
    "centre": "centre",
    "center": "centre",
    "middle": "centre",
    "centered": "centre",
    "centred": "centre",
}
SIZE_WORDS: dict[str, str] = {
    "small": "small",
    "little": "small",
    "tiny": "small",
    "smaller": "small",
    "large": "large",
    "big": "large",
    "huge": "large",
    "larger": "large",
    "bigger": "large",
}
BACKGROUND_WORDS = frozenset({"background", "backdrop", "canvas", "backgrounds"})

_TOKEN = re.compile(r"[a-z]+|\+")


def caption(scene: Scene, style: CaptionStyle = "short") -> str:
    """Describe ``scene`` in words.

    Styles:
        * ``"short"``: ``"a red circle on a blue background"``
        * ``"long"``: ``"a small red circle at the left on a blue background"``
        * ``"tag"``: ``"small, red, circle, left, blue background"``
    """
    if style == "short":
        return f"a {scene.color} {scene.shape} on a {scene.background} background"
    if style == "long":
        where = POSITION_PHRASES[scene.position]
        return f"a {scene.size} {scene.color} {scene.shape} {where} on a {scene.background} background"
    if style == "tag":
        return f"{scene.size}, {scene.color}, {scene.shape}, {scene.position}, {scene.background} background"
    raise ValueError(f"unknown caption style {style!r}; expected one of {CAPTION_STYLES}")


def _tokens(text: str) -> list[str]:
    return _TOKEN.findall(text.lower().replace("colour", "color"))


def _nearest(indices: list[int], anchor: int, before: int, after: int) -> int | None:
    """The index in ``indices`` closest to ``anchor`` within the window, preferring before."""
    best = None
    for i in indices:
        d = anchor - i
        if (0 < d <= before) or (0 < -d <= after):
            key = (abs(d), d < 0)
            if best is None or key < best[0]:
                best = (key, i)
    return None if best is None else best[1]


def _unique(values: list[str]) -> str | None:
    distinct = set(values)
    return values[0] if len(distinct) == 1 else None


def parse_caption(text: str) -> PartialScene:
    """Extract scene fields from free text; fields not stated (or ambiguous) are ``None``.

    Rules: the colour word nearest before (else just after) a background word
    is the background colour; the colour word nearest before (else just
    after) the first shape word is the shape colour; a single remaining
    colour becomes the shape colour.  Position/size words count only when
    all mentions agree.
    """
    toks = _tokens(text)
    colors = {i: COLOR_WORDS[t] for i, t in enumerate(toks) if t in COLOR_WORDS}
    shape_idx = [i for i, t in enumerate(toks) if t in SHAPE_WORDS]
    shape = _unique([SHAPE_WORDS[toks[i]] for i in shape_idx])
    bg_idx = [i for i, t in enumerate(toks) if t in BACKGROUND_WORDS]

    background: str | None = None
    used: set[int] = set()
    for b in bg_idx:
        # "a blue background" / "the background is blue" / "background colour: blue"
        j = _nearest(list(colors), b, before=2, after=4)
        if j is not None:
            background, used = colors[j], used | {j}
            break

    free = [i for i in colors if i not in used]
    anchors = shape_idx or [i for i, t in enumerate(toks) if t in GENERIC_SHAPE_WORDS]
    color: str | None = None
    for a in anchors:
        j = _nearest(free, a, before=3, after=3)
        if j is not None:
            color = colors[j]
            break
    if color is None and len(set(colors[i] for i in free)) == 1:
        color = colors[free[0]]

    positions = [POSITION_WORDS[t] for t in toks if t in POSITION_WORDS]
    sizes = [SIZE_WORDS[t] for t in toks if t in SIZE_WORDS]
    parsed = PartialScene(
        shape=shape,
        color=color,
        background=background,
        position=_unique(positions),
        size=_unique(sizes),
    )
    logger.debug("parse_caption(%r) -> %s", text, parsed)
    return parsed


def score_caption(text: str, scene: Scene) -> dict[str, bool]:
    """Per-attribute correctness of a description (e.g. a VLM answer) of ``scene``.

    Position and size are only meaningful for answers asked to give them.
    """
    return parse_caption(text).compare(scene)
