"""Prompt normalisation for the shipped shape-world models: common paraphrases -> the trained captions.

The default models were trained on the world's canonical captions only (``caption`` and
``clip_caption``: "a small red circle at the left on a blue background", "a red circle moving
rightwards on a blue background"). A paraphrase of the same words ("a red circle on a blue
background at the left", "moving from left to right") reaches the text encoder as a sentence it
never saw, and the model draws something else. These functions rewrite a prompt that names the
world's attributes, in any order and with the synonyms below, into the caption the model knows:

- words: :data:`~shapeworld.captions.SHAPE_WORDS`, ``COLOR_WORDS``, ``POSITION_WORDS`` and
  ``SIZE_WORDS`` (purple -> magenta, plus -> cross, center/middle -> centre, big -> large, ...);
- positions: "at/on/to the left", "on the left side", "left" (and so on for each position);
- directions (video): "rightwards", "rightward", "to the right", "right", "from left to right",
  "left to right" (and so on for each direction);
- order: the attributes in any order, joined by "a", "on", "with", "is", commas, ...

A prompt is rewritten only when every word in it is understood and it names shape, colour and
background (and, for an image, both size and position or neither; for a video, the direction);
anything else (other words, a missing attribute, two colours for one thing) is passed unchanged, so
it never turns a prompt into a scene the user did not describe. A canonical caption of any style
(short, long, tag) is its own normal form. Edit instructions get the word-level synonyms only.
Deterministic and pure; the family adapters apply it only to models whose ``triptych.json`` says
``"prompt_normaliser": "shapes"`` (image and edit) or ``"shapes-video"``: the shipped defaults.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable

from shapeworld.captions import (
    BACKGROUND_WORDS,
    COLOR_WORDS,
    GENERIC_SHAPE_WORDS,
    POSITION_WORDS,
    SHAPE_WORDS,
    SIZE_WORDS,
    caption,
)
from shapeworld.scene import Scene

logger = logging.getLogger(__name__)

#: Words that carry no attribute and may appear anywhere in a normalisable prompt.
FILLER = frozenset(
    "a an the one single on in at of with to is and that which its it's colored coloured color colour side "
    "moving moves move going goes travelling traveling sliding slides drifting heading across over "
    "picture image photo drawing".split()
)
DIRECTION_PHRASES: dict[str, tuple[str, ...]] = {
    # Longest first: "from left to right" must not leave "left" and "right" behind as positions.
    "rightwards": ("from left to right", "left to right", "to the right", "rightwards", "rightward", "right"),
    "leftwards": ("from right to left", "right to left", "to the left", "leftwards", "leftward", "left"),
    "downwards": ("from top to bottom", "top to bottom", "downwards", "downward", "down"),
    "upwards": ("from bottom to top", "bottom to top", "upwards", "upward", "up"),
}
_WORD = re.compile(r"[a-z]+|\+")


def _words(text: str) -> list[str]:
    return _WORD.findall(text.lower().replace("colour", "color"))


def _attributes(words: list[str]) -> dict[str, str] | None:
    """shape, color, background, position, size from words (no filler left), or None when any word
    is not understood or an attribute is stated twice differently."""
    found: dict[str, str] = {}

    def put(key: str, value: str) -> bool:
        if found.get(key, value) != value:
            return False
        found[key] = value
        return True

    colors: list[tuple[int, str]] = []
    background_at: list[int] = []
    for i, w in enumerate(words):
        if w in COLOR_WORDS:
            colors.append((i, COLOR_WORDS[w]))
        elif w in BACKGROUND_WORDS:
            background_at.append(i)
        elif w in SHAPE_WORDS:
            if not put("shape", SHAPE_WORDS[w]):
                return None
        elif w in POSITION_WORDS:
            if not put("position", POSITION_WORDS[w]):
                return None
        elif w in SIZE_WORDS:
            if not put("size", SIZE_WORDS[w]):
                return None
        elif w not in FILLER and w not in GENERIC_SHAPE_WORDS:
            return None
    if len(colors) != 2 or len(background_at) != 1:
        return None
    # The background's colour is the one right before the background word ("a blue background"),
    # else right after it ("background blue", "the background is blue").
    b = background_at[0]
    before = [c for c in colors if c[0] < b]
    after = [c for c in colors if c[0] > b]
    bg = before[-1] if before and (not after or b - before[-1][0] <= 2) else (after[0] if after else None)
    if bg is None:
        return None
    (shape_color,) = [c for c in colors if c is not bg]
    found["background"], found["color"] = bg[1], shape_color[1]
    return found


def normalise_image_prompt(prompt: str) -> str:
    """The trained caption for a paraphrase of one (module docstring); other prompts unchanged."""
    attrs = _attributes(_words(prompt))
    if attrs is None or not {"shape", "color", "background"} <= attrs.keys():
        return prompt
    if attrs["color"] == attrs["background"]:
        return prompt
    has_pos, has_size = "position" in attrs, "size" in attrs
    if has_pos != has_size:
        return prompt
    scene = Scene(
        attrs["shape"], attrs["color"], attrs["background"], attrs.get("position", "centre"), attrs.get("size", "large")
    )
    if prompt.strip() in {caption(scene, s) for s in ("short", "long", "tag")}:
        return prompt
    return caption(scene, "long" if has_pos else "short")


def _take_direction(text: str) -> tuple[str | None, str]:
    """(direction, the text without its direction phrase) for exactly one direction phrase."""
    low = " ".join(_words(text))
    hits = []
    for direction, phrases in DIRECTION_PHRASES.items():
        for phrase in phrases:
            for m in re.finditer(rf"\b{re.escape(phrase)}\b", low):
                hits.append((m.start(), m.end(), direction))
    # Keep the longest phrase at each place; overlapping shorter ones are part of it.
    hits.sort(key=lambda h: (h[0], -(h[1] - h[0])))
    kept: list[tuple[int, int, str]] = []
    for h in hits:
        if not kept or h[0] >= kept[-1][1]:
            kept.append(h)
    if len({d for _, _, d in kept}) != 1:
        return None, low
    rest = low
    for start, end, _ in reversed(kept):
        rest = rest[:start] + " " + rest[end:]
    return kept[0][2], rest


def normalise_video_prompt(prompt: str) -> str:
    """The trained clip caption for a paraphrase of one (module docstring); other prompts unchanged."""
    from shapeworld.video import Clip, clip_caption

    direction, rest = _take_direction(prompt)
    if direction is None:
        return prompt
    attrs = _attributes(_words(rest))
    if attrs is None or not {"shape", "color", "background"} <= attrs.keys() or "position" in attrs:
        return prompt
    if attrs["color"] == attrs["background"]:
        return prompt
    clip = Clip(attrs["shape"], attrs["color"], attrs["background"], direction, attrs.get("size", "large"))
    if prompt.strip() in {clip_caption(clip, s) for s in ("short", "long", "tag")}:
        return prompt
    return clip_caption(clip, "long" if "size" in attrs else "short")


_EDIT_SYNONYMS = {
    **{w: v for w, v in COLOR_WORDS.items() if w != v},
    **{w: v for w, v in SHAPE_WORDS.items() if w != v and w.isalpha() and w not in ("round",)},
    "center": "centre",
    "middle": "centre",
    "larger": "bigger",
}


def normalise_edit_prompt(prompt: str) -> str:
    """Word-level synonyms only (purple -> magenta, plus -> cross, center -> centre, larger -> bigger):
    an edit instruction's wording is the user's; only the words are mapped to the trained ones."""
    return re.sub(r"[A-Za-z]+", lambda m: _EDIT_SYNONYMS.get(m.group(0).lower(), m.group(0)), prompt)


def _shapes(prompt: str, edit: bool) -> str:
    return normalise_edit_prompt(prompt) if edit else normalise_image_prompt(prompt)


def _shapes_video(prompt: str, edit: bool) -> str:
    return normalise_video_prompt(prompt)


#: ``triptych.json`` ``"prompt_normaliser"`` -> f(prompt, is_edit) -> the prompt the encoder gets.
NORMALISERS: dict[str, Callable[[str, bool], str]] = {"shapes": _shapes, "shapes-video": _shapes_video}


def normaliser(name: str | None) -> Callable[[str, bool], str] | None:
    """The normaliser a model's ``triptych.json`` names (``"prompt_normaliser"``), None for none."""
    if name is None:
        return None
    if name not in NORMALISERS:
        raise ValueError(f"unknown prompt_normaliser {name!r}; expected one of {', '.join(NORMALISERS)}")
    return NORMALISERS[name]


__all__ = ["normalise_edit_prompt", "normalise_image_prompt", "normalise_video_prompt", "normaliser"]
