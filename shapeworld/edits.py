"""Edit pairs: a source scene, an instruction, and the target scene.

Every pair changes exactly one attribute.  Train pairs have source *and*
target in train combinations (so training never sees a held-out
combination); held-out pairs have a held-out *target* combination.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import re
from dataclasses import dataclass

from shapeworld.captions import COLOR_WORDS, POSITION_WORDS, SHAPE_WORDS
from shapeworld.scene import (
    ATTRIBUTES,
    COLOR_NAMES,
    POSITIONS,
    SHAPES,
    SIZES,
    Scene,
    Split,
    in_split,
    make_rng,
    sample_scene,
)

logger = logging.getLogger(__name__)

TEMPLATES: dict[str, tuple[str, ...]] = {
    "color": ("make the {shape} {new}", "change the {shape} to {new}", "colour the {shape} {new}"),
    "background": ("change the background to {new}", "make the background {new}"),
    "shape": ("make it a {new}", "turn the {shape} into a {new}"),
    "position": ("move the {shape} to the {new}",),
    "size": ("make the {shape} {new}",),
}
_SIZE_VERBS = {"large": "bigger", "small": "smaller"}
_VALUES: dict[str, tuple[str, ...]] = {
    "shape": SHAPES,
    "color": COLOR_NAMES,
    "background": COLOR_NAMES,
    "position": POSITIONS,
    "size": SIZES,
}


@dataclass(frozen=True)
class EditPair:
    """One edit example.

    Attributes:
        source: scene before the edit.
        instruction: text such as ``"make the circle green"``.
        target: scene after the edit (differs from ``source`` in ``attribute`` only).
        attribute: the changed attribute, one of :data:`ATTRIBUTES`.
    """

    source: Scene
    instruction: str
    target: Scene
    attribute: str


def changed_attributes(a: Scene, b: Scene) -> list[str]:
    """Attributes whose values differ between two scenes."""
    return [k for k in ATTRIBUTES if getattr(a, k) != getattr(b, k)]


def edit_instruction(source: Scene, attribute: str, value: str, variant: int = 0) -> str:
    """Instruction text that sets ``attribute`` of ``source`` to ``value``."""
    templates = TEMPLATES[attribute]
    new = _SIZE_VERBS[value] if attribute == "size" else value
    return templates[variant % len(templates)].format(shape=source.shape, new=new)


def make_edit(source: Scene, attribute: str, value: str, variant: int = 0) -> EditPair:
    """Build the pair that sets ``attribute`` to ``value``.

    Raises:
        ValueError: if the value is unchanged or the target would be invalid
            (e.g. shape colour equal to the background colour).
    """
    if attribute not in ATTRIBUTES:
        raise ValueError(f"unknown attribute {attribute!r}")
    if getattr(source, attribute) == value:
        raise ValueError(f"{attribute} is already {value!r}")
    target = dataclasses.replace(source, **{attribute: value})
    return EditPair(source, edit_instruction(source, attribute, value, variant), target, attribute)


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z]+", text.lower().replace("center", "centre"))


def apply_instruction(scene: Scene, instruction: str) -> Scene | None:
    """Apply an instruction in the template language to ``scene``.

    Returns ``None`` when the instruction is not understood or gives an
    invalid scene.  Useful to score an editor against free-form prompts.
    """
    words = _words(instruction)
    change: tuple[str, str] | None = None
    colors = [COLOR_WORDS[w] for w in words if w in COLOR_WORDS]
    if "background" in words and colors:
        change = ("background", colors[-1])
    elif {"bigger", "larger"} & set(words):
        change = ("size", "large")
    elif {"smaller"} & set(words):
        change = ("size", "small")
    elif "move" in words and any(w in POSITION_WORDS for w in words):
        change = ("position", [POSITION_WORDS[w] for w in words if w in POSITION_WORDS][-1])
    elif colors:
        change = ("color", colors[-1])
    else:
        shapes = [SHAPE_WORDS[w] for w in words if w in SHAPE_WORDS]
        if shapes:
            change = ("shape", shapes[-1])
    if change is None:
        return None
    try:
        return dataclasses.replace(scene, **{change[0]: change[1]})
    except ValueError:
        return None


def _sample_pair(rng: random.Random, split: Split) -> EditPair:
    attribute = rng.choice(ATTRIBUTES)
    variant = rng.randrange(len(TEMPLATES[attribute]))
    if split == "heldout":
        # Held-out by target: draw the target, then undo one attribute.
        while True:
            target = sample_scene(rng, "heldout")
            old = rng.choice([v for v in _VALUES[attribute] if v != getattr(target, attribute)])
            try:
                source = dataclasses.replace(target, **{attribute: old})
            except ValueError:
                continue
            return make_edit(source, attribute, getattr(target, attribute), variant)
    while True:
        source = sample_scene(rng, split)
        new = rng.choice([v for v in _VALUES[attribute] if v != getattr(source, attribute)])
        try:
            pair = make_edit(source, attribute, new, variant)
        except ValueError:
            continue
        if in_split(pair.target, split):
            return pair


def sample_edit_pairs(n: int, seed: int | str = 0, split: Split = "train") -> list[EditPair]:
    """Deterministically sample ``n`` edit pairs of ``split`` from ``seed``.

    Attributes are drawn uniformly; instruction wording varies by template.
    """
    if n < 0:
        raise ValueError("n must be >= 0")
    rng = make_rng(seed, "edits", split)
    return [_sample_pair(rng, split) for _ in range(n)]
